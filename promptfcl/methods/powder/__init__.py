"""Powder: Federated Continual Learning via Prompt-based Dual Knowledge Transfer (Piao, Wu, Wu, Wei; ICML 2024,
PMLR 235:40725-40739; code piaohongming/Powder, read at dc32d30: `src/fl_main_hard.py`, `src/Fed_utils.py`,
`src/models_Cprompt/vit_coda_p{,_hard}.py`, `src/prompt_hard.py`, run `powder_job.slurm`:
`--prompt_flag codap_2d_v2 --method cprompt_powder_v2`).

Sources and tags. Only the paper's abstract was available here ([P]: prompt-based knowledge transfer between tasks
learned by different clients at different times, prompt generation and aggregation that lower communication and
privacy exposure); the algorithm below is read from the code ([C]) and from C2Prompt's note on Powder
(`../shared/methods.md` §2, [N]); [I] marks our choices. Powder's benchmark is the asynchronous scenario that
already exists (`scenario.kind: asynchronous`, `scenario.asynchronous`: per-(client, task) slots, ⌊K/2⌋ clients
switch per stage of 3 rounds) with task-aware evaluation per (client, task) and a direct reference run for FWT.

Per label-space task g (one (client, task)), per prompted layer (default 4-6 [C]): a block of N = 10 CODA-P
components of length 8 (P_g, keys K_g, attention vectors A_g) [C: `prompt_param 25 10 10 8`], drawn by
Gram-Schmidt orthogonal to every earlier drawn block when g first appears in the schedule [C `process_frequency`].
The server keeps every block (the task pool), the task-correlation matrix W (identity until measured) and the
set of trained tasks.

1. Task correlation, round 0 of every stage [C `updateweight_with_promptchoosing`]: each participant computes its
   task's prompt-choosing signature — per class of its task, the mean over the class's images of CODA-P's
   α = cos(q(x) ⊙ A, K) over the components of every trained task's generated block (K and A of G_i below; the
   unprompted query q(x)), per layer; the task signature is the mean of its class means — and uploads the class
   means ([I]: the code reads every client's images on the server). For tasks t1, t2, the similarity is the mean
   over layers of the cosine of their signatures restricted to the tasks both were measured against;
   W[t1, t2] ∝ max(sim, 0)^`correlation_power` (30 [C `task_index`]), each row normalised to sum 1 over the tasks
   with a signature (the code keeps all of them: `topk_for_task` = number of tasks).
2. Prompt generation and aggregation (forward and backward transfer) [C `CodaPrompt_2d_v2.forward`]: every task i
   has a generated block G_i = Σ_j W[i, j]·P_j over the trained tasks (the same mix for K and A). Task g is served
   by the `top_k` (3 [C `topk_for_task_selection`]) generated blocks G_i with the largest W[g, i]: their k·N
   components weighted by α, the summed prompt divided by k, prepended as prefix keys/values. While g trains only
   P_g learns (through the weight W[i, g] in every selected G_i); the other blocks are fixed. Forward transfer:
   a new task's prompt is built from the correlated earlier tasks' blocks. Backward transfer: W is re-measured
   every stage, so an earlier task's generated blocks take in later tasks' blocks as soon as they correlate, and
   its evaluation uses the current W and pool.
3. Server aggregation [C `FedAvg_our_v1`]: block g is the mean of the blocks uploaded by the clients training g —
   in this benchmark exactly its one owner; head rows likewise (`federation.aggregation.owner_row_mean`).
4. Local loss [C `prompt_hard._compute_loss`, `cprompt_powder_v2`]: CE over the task's own slots + `ntd_weight`
   (1 [C]) × the not-true distillation of FedNTD from the model the client received: τ² KL(softmax(t/τ) ‖
   softmax(s/τ)) over the task's slots other than the label, τ = 3 [C], each sample weighted by the softmax over
   the batch of 1 − max_c F[y, c], F the class-correlation matrix (class signatures as in 1, other classes of the
   same task set to 0, power `class_power` 30, the `class_top_k` 3 largest kept, rows normalised [C
   `fc_weight`, `calculate_distillation_weight`]); not in the run's first round (the code's `ep_g > 0`). This is
   "Powder's distillation term" C2Prompt keeps ([N]); C2Prompt on this base: `c2prompt` with `base: powder`.

Communication ([I], the paper's stated aim; the code sends the whole model both ways): the downlink of a
participant is its own block, the k fixed remainders R_i = Σ_{j≠g} W[i, j]·P_j with their coefficients W[i, g]
(`prompts.generated`: the same forward, term for term) and the head; the uplink its own block and the head; round
0 adds the generated keys/attention of the trained tasks down and the class signatures up. Other clients' raw
task prompts never leave the server.

Paper-vs-code and our switches (→ default):
- Prompt injection: the run's code ("v2") prepends the 8 prompt tokens as extra input tokens to blocks 4-6 and reads
  the CLS at index 24; here the backbone's one prefix path (half keys, half values — the same code's non-"v2"
  path and CODA-P's) [I: promptfcl has one injection mechanism].
- CE over the task's own slots (`train_logits: current_task`), as the code (its training forward sets every other
  class's logit to -inf). With task-aware evaluation only the own slots compete at test time.
- The signature of a client's previous task is not re-measured when the client switches (the code re-reads that
  task's images from the shared dataset object; a client here holds only its current task's data) [I]; old
  tasks still take in new tasks' blocks through the similarity over their common columns.
- Signatures use the current W (the code keeps a lagged copy `weight_c` for them) [I]; negative similarities
  count as 0 (the code's even power 30 would count them as strongly related) [I].
- Local training: Adam lr 0.005 [C], 10 local epochs, batch 64 [C], CODA-P's per-epoch cosine (the code's
  `CosineSchedule(K=50)` over 10 epochs) [I], all 5 clients every round.
- Not implemented: the code's "classincremental" task-detection branch and "extension" consolidation (not used by
  the paper's runs), its `global_task_id_real` merging of duplicate tasks (disabled in the code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from promptfcl.evaluation.validity import prompt_mechanism
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, Grid, MethodEnv, RoundInfo, handles
from promptfcl.federation.validation import ReplySchema, TensorSpec
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import FedAvgServer, SupervisedClient, loss_scalars
from promptfcl.methods.base.prompt_models import PoolTrainingParams, pooled_model
from promptfcl.methods.powder.generated import PARTS, GeneratedTaskPrompt
from promptfcl.model import PromptedClassifier
from promptfcl.prompts.codap import attention_weights
from promptfcl.prompts.pools import gram_schmidt_
from promptfcl.scenario.label_space import masked_logits
from promptfcl.seeding import derive_seed
from promptfcl.statistics.class_stats import extract_features
from promptfcl.training.local import LossFn, LossTerms

Signature = tuple[list[int], torch.Tensor]  # (the trained tasks it was measured against, (layers, tasks·N))


class PowderKnobs(BaseModel):
    """Powder's transfer and distillation knobs (official code's values), shared with C2Prompt's Powder base."""

    model_config = ConfigDict(extra="forbid")
    top_k: int = Field(3, gt=0, description="generated task prompts serving a task (code topk_for_task_selection)")
    correlation_power: float = Field(30.0, gt=0, description="W ∝ similarity^power (code task_index)")
    class_power: float = Field(30.0, gt=0, description="class correlation ∝ similarity^power (code class_index)")
    class_top_k: int = Field(3, gt=0, description="class correlations kept per class (code topk_for_class)")
    ntd_weight: float = Field(1.0, ge=0, description="not-true distillation from the received model (0: off)")
    ntd_temperature: float = Field(3.0, gt=0)


class PowderParams(PowderKnobs, PoolTrainingParams):
    """Powder's prompt shape and local training (official run script `powder_job.slurm`)."""

    components_per_task: int = Field(10, gt=0, description="CODA-P components of each (client, task) block")
    length: int = Field(8, gt=0)
    layers: list[int] = Field(default_factory=lambda: [4, 5, 6])
    lr: float = Field(0.005, gt=0)


def powder_model(env: MethodEnv, p: PoolTrainingParams, components: int, length: int, layers: list[int],
                 blocks: int) -> PromptedClassifier:  # fmt: skip
    """A frozen backbone + one (client, task)'s generated prompt with `blocks` generated-block slots + head."""
    return pooled_model(env, p, GeneratedTaskPrompt(env.backbone.embed_dim, layers, components, length, blocks))  # type: ignore[arg-type]


def build_model(env: MethodEnv, p: PowderParams) -> PromptedClassifier:
    return powder_model(env, p, p.components_per_task, p.length, p.layers, p.top_k)


# ------------------------------------------------------------------------------------------- the math
def top_tasks(W: torch.Tensor, trained: list[int], g: int, k: int) -> list[int]:
    """The k trained tasks i with the largest W[g, i] (ties: the earlier task)."""
    cols = torch.tensor(trained, dtype=torch.long)
    order = torch.sort(W[g, cols], descending=True, stable=True).indices[:k]
    return cols[order].tolist()


def generate(
    pool: dict[str, torch.Tensor], W: torch.Tensor, trained: list[int], g: int | None, picks: list[int], blocks: int
) -> dict[str, torch.Tensor]:
    """The `GeneratedTaskPrompt` state serving task g: own block P_g, and for each picked task i the remainder
    R_i = Σ_{j trained, j≠g} W[i, j]·P_j and coefficient W[i, g]. g = None: no own block (the global view)."""
    cols = torch.tensor(trained, dtype=torch.long)
    out: dict[str, torch.Tensor] = {}
    for part, t in pool.items():
        rest = torch.zeros(blocks, *t.shape[1:])
        for slot, i in enumerate(picks):
            w = W[i, cols].double()
            if g is not None:
                w = torch.where(cols == g, torch.zeros_like(w), w)
            acc = torch.zeros(t.shape[1:], dtype=torch.float64)  # block by block: no float64 copy of the pool
            for j, wj in zip(trained, w.tolist(), strict=True):
                if wj != 0.0:
                    acc += wj * t[j].double()
            rest[slot] = acc.float()
        out[f"prompt.rest_{part}"] = rest
        out[f"prompt.own_{part}"] = t[g].clone() if g is not None else torch.zeros(t.shape[1:])
    coef, active = torch.zeros(blocks), torch.zeros(blocks)
    active[: len(picks)] = 1
    if g is not None and picks:
        coef[: len(picks)] = W[torch.tensor(picks), g]
    out["prompt.coef"], out["prompt.active"] = coef, active
    return out


def signature_similarity(a: Signature, b: Signature, components: int) -> float:
    """Mean over layers of the cosine between two signatures on the tasks both were measured against."""
    common = sorted(set(a[0]) & set(b[0]))
    if not common:
        return 0.0

    def view(s: Signature) -> torch.Tensor:
        idx = torch.tensor([s[0].index(t) for t in common])
        v = s[1].double().view(s[1].shape[0], len(s[0]), components)[:, idx]
        return F.normalize(v.flatten(1), dim=1)

    return float((view(a) * view(b)).sum(1).mean())


def correlation(
    sigs: dict[int, Signature],
    components: int,
    power: float,
    top_k: int | None = None,
    group: dict[int, int] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """(keys, rows) of W[a, b] ∝ max(sim, 0)^power over the signed keys, rows summing to 1. `group`: keys of one
    group (a task's classes) get 0 for each other; `top_k`: only each row's k largest entries are kept."""
    keys = sorted(sigs)
    n = len(keys)
    sim = torch.eye(n, dtype=torch.float64)
    for a in range(n):
        for b in range(a + 1, n):
            sim[a, b] = sim[b, a] = signature_similarity(sigs[keys[a]], sigs[keys[b]], components)
    w = sim.clamp_min(0) ** power
    if group is not None:
        g = torch.tensor([group[k] for k in keys])
        w = torch.where((g[:, None] == g[None, :]) & ~torch.eye(n, dtype=torch.bool), torch.zeros_like(w), w)
    if top_k is not None and top_k < n:
        keep = torch.zeros_like(w, dtype=torch.bool)
        keep.scatter_(1, torch.sort(w, dim=1, descending=True, stable=True).indices[:, :top_k], True)
        w = torch.where(keep, w, torch.zeros_like(w))
    return keys, (w / w.sum(1, keepdim=True).clamp_min(1e-300)).float()


def not_true_distillation(
    student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor, tau: float
) -> torch.Tensor:
    """Σ_b weight_b · τ² KL(softmax(teacher/τ) ‖ softmax(student/τ)) over the `slots` logits other than y_b."""
    n = len(slots) - 1
    if n < 1:
        return student.new_zeros(())
    keep = slots.unsqueeze(0) != y.unsqueeze(1)  # (B, C): every row drops exactly its label
    s = student[:, slots][keep].view(-1, n) / tau
    t = teacher[:, slots][keep].view(-1, n) / tau
    kl = (F.softmax(t, 1) * (F.log_softmax(t, 1) - F.log_softmax(s, 1))).sum(1) * tau * tau
    return (weight * kl).sum()


# ------------------------------------------------------------------------------------------- client
class PowderClient(SupervisedClient):
    """Prompt-choosing signature (round 0 of a stage); CE + not-true distillation on the generated prompt."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._received: nn.Module | None = None  # a working copy, reloaded from every train message

    def slots(self, ctx: ClientContext) -> torch.Tensor:
        return torch.tensor(ctx.space(self.env).tasks[ctx.label_task].logits, dtype=torch.long)

    @torch.no_grad()
    @handles("signature")
    def signature(self, message: Message, ctx: ClientContext) -> Message:
        """Per class of the task: mean α of q(x) over the components of every trained task's generated block."""
        keys = message.tensors["powder/keys"].to(ctx.device)  # (tasks, layers, N, d)
        att = message.tensors["powder/attention"].to(ctx.device)
        layers = keys.shape[1]
        K, A = keys.transpose(0, 1).flatten(1, 2), att.transpose(0, 1).flatten(1, 2)  # (layers, tasks·N, d)

        def alphas(x: torch.Tensor) -> torch.Tensor:
            q = self.env.backbone.query(x)
            return torch.cat([attention_weights(q, K[i], A[i]) for i in range(layers)], dim=1)

        slots = self.slots(ctx)
        feats, ys = extract_features(alphas, ctx.train_data, self.env.eval_transform, ctx.device)
        index = torch.full((self.env.label_space.num_logits,), -1, dtype=torch.long)
        index[slots] = torch.arange(len(slots))
        width = layers * K.shape[1]
        sums = torch.zeros(len(slots), width, dtype=torch.float64)
        counts = torch.zeros(len(slots), dtype=torch.long)
        if len(ys):
            sums.index_add_(0, index[ys], feats)
            counts = torch.bincount(index[ys], minlength=len(slots))
        means = (sums / counts.clamp_min(1).unsqueeze(1)).float().view(len(slots), layers, -1)
        tensors = {"powder/class_signature": means, "powder/class_count": counts}
        return Message(tensors, {"num_samples": len(ctx.train_data)}, kind="signature_reply")

    def teacher(self, message: Message) -> nn.Module:
        """The model as received (the distillation teacher)."""
        if self._received is None:
            self._received = self.new_model()
        self._received.set_state({k: message.tensors[k] for k in self._received.state_dict()})
        return self._received.eval()

    def ntd_term(self, message: Message, ctx: ClientContext):  # noqa: ANN201 - (x, y, logits) → loss, or None
        """Powder's weighted not-true distillation from the received model, or None when off this round."""
        p = self.params
        if p.ntd_weight <= 0 or not message.scalars.get("ntd", False):
            return None
        teacher, slots = self.teacher(message), self.slots(ctx).to(ctx.device)
        class_weight = message.tensors["powder/ntd_class_weight"].to(ctx.device)

        def term(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                t_logits = teacher(x)
            weight = torch.softmax(class_weight[y - slots[0]], dim=0)
            return p.ntd_weight * not_true_distillation(logits, t_logits, y, slots, weight, p.ntd_temperature)

        return term

    def loss_fn(self, message: Message, ctx: ClientContext) -> LossFn:
        ntd = self.ntd_term(message, ctx)

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> LossTerms:
            logits = model(x)
            ce = F.cross_entropy(masked_logits(logits, mask), y)
            return LossTerms(ce if ntd is None else ce + ntd(x, y, logits), ce)

        return loss

    def reply(self, model: nn.Module, ctx: ClientContext, stats: dict[str, float]) -> Message:
        """Only the own block and the head go up (the generated remainders are the server's)."""
        up = {k: v for k, v in model.get_state().items() if k.startswith(("head.", "prompt.own_"))}
        return Message(up, {"num_samples": len(ctx.train_data), **loss_scalars(stats)}, kind="train_reply")


# ------------------------------------------------------------------------------------------- server
class PowderServer(FedAvgServer):
    """Task pool, task / class correlations, per-task generated downlinks, owner aggregation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.env.schedule is None:
            raise ValueError("Powder needs per-(client, task) output slots: use scenario.kind: asynchronous")
        prompt: GeneratedTaskPrompt = self.model.prompt  # type: ignore[assignment]
        T = self.env.label_space.num_tasks
        self.components = prompt.own_prompts.shape[1]
        self.pool = {part: torch.zeros(T, *getattr(prompt, f"own_{part}").shape) for part in PARTS}
        self.W = torch.eye(T)
        self.drawn = torch.zeros(T, dtype=torch.bool)
        self.trained = torch.zeros(T, dtype=torch.bool)
        self.class_weight = torch.zeros(self.env.label_space.num_logits)  # 1 − max class correlation per logit
        self.signatures: dict[int, Signature] = {}  # label task → its prompt-choosing signature
        self.class_signatures: dict[int, Signature] = {}  # logit → its class signature
        self._global: PromptedClassifier | None = None
        # this round's participants' label tasks and the base's downlink extras (set by `before_round`)
        self.labels: dict[int, int] = {}
        self.extras: dict[int, dict[str, torch.Tensor]] = {}
        self.extra_scalars: dict[str, object] = {}

    # -------------------------------------------------------------------- blocks and generation
    def begin_stage(self, task: int) -> None:
        for g in sorted(set(self.env.schedule[task])):  # type: ignore[index]
            if not self.drawn[g]:
                self.draw(g)

    def draw(self, g: int) -> None:
        """Block g by Gram-Schmidt, orthogonal to every block drawn before (per layer; prompts, keys, attention)."""
        earlier = self.drawn.nonzero().flatten()
        n = len(earlier) * self.components
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.env.seed, "powder_block", g))
            for t in self.pool.values():
                for layer in range(t.shape[1]):
                    rows = torch.cat([t[earlier, layer].flatten(0, 1), t[g, layer]])
                    gram_schmidt_(rows, n, len(rows))
                    t[g, layer] = rows[n:]
        self.drawn[g] = True

    def trained_tasks(self) -> list[int]:
        return self.trained.nonzero().flatten().tolist()

    def task_state(self, g: int) -> dict[str, torch.Tensor]:
        """What serves task g: its generated prompt (own block + top-k remainders) and the global head."""
        trained = self.trained_tasks()
        picks = top_tasks(self.W, trained, g, self.params.top_k)
        head = {f"head.{k}": v.detach().clone() for k, v in self.model.head.state_dict().items()}
        return {**generate(self.pool, self.W, trained, g, picks, self.params.top_k), **head}

    def model_with_blocks(self, blocks: int) -> PromptedClassifier:
        prompt: GeneratedTaskPrompt = self.model.prompt  # type: ignore[assignment]
        length = prompt.own_prompts.shape[2]
        p = GeneratedTaskPrompt(self.env.backbone.embed_dim, prompt.layers, self.components, length, blocks)
        with torch.random.fork_rng(devices=[]):  # a head init must not move the run's RNG
            m = PromptedClassifier(self.env.backbone, self.env.label_space.num_logits, p)
        return m.to(self.env.device).eval()

    # -------------------------------------------------------------------- the round
    def before_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """Mark the participants' tasks trained; at round 0 correlate them; the base's extras for the downlink."""
        self.labels = {k: self.env.label_task(info.stage, k) for k in info.participants}
        for g in self.labels.values():
            self.trained[g] = True
        metrics = self.correlate(grid, info) if info.round == 0 else {}
        self.extras, self.extra_scalars = self.round_extras(grid, info)
        return metrics

    def configure(self, info: RoundInfo) -> dict[int, Message]:
        """Each participant gets its task's generated prompt and head (one per task, not per client)."""
        ntd = not (info.stage == 0 and info.round == 0)
        served = {g: self.task_state(g) for g in sorted(set(self.labels.values()))}
        msgs = {}
        for k, g in self.labels.items():
            own = {"powder/ntd_class_weight": self.class_weight[list(self.env.label_space.tasks[g].logits)].clone()}
            tensors = {**served[g], **own, **self.extras.get(k, {})}
            msgs[k] = Message(tensors, {"ntd": ntd, **self.extra_scalars}, kind="train")
        return msgs

    def aggregate(self, replies: dict[int, Message]) -> dict[str, float]:
        return self.absorb(replies, self.labels)

    def reply_metrics(self, replies: dict[int, Message]) -> dict[str, float]:
        """Round metrics read from every reply, trained or not (C2Prompt's LCDC diagnostics)."""
        return {}

    def round_extras(
        self, grid: Grid, info: RoundInfo
    ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, object]]:
        """Per-client tensors and shared scalars added to this round's train messages (C2Prompt's hook)."""
        return {}, {}

    def absorb(self, replies: dict[int, Message], labels: dict[int, int]) -> dict[str, float]:
        """Each uploaded block replaces its task's block (its one owner); head rows from their owners."""
        blocks = {labels[k]: {part: r.tensors[f"prompt.own_{part}"] for part in PARTS} for k, r in replies.items()}
        self.store_blocks(blocks)
        previous = self.model.get_state()
        weights = [r.scalars["num_samples"] for r in replies.values()] if self.params.weighting == "samples" else None
        self.model.set_state({**previous, **self.owned_head(previous, replies, weights)})
        return {}

    def store_blocks(self, blocks: dict[int, dict[str, torch.Tensor]]) -> None:
        for g, parts in blocks.items():
            for part, t in parts.items():
                self.pool[part][g] = t.detach().to(self.pool[part].dtype)

    # -------------------------------------------------------------------- correlations
    def correlate(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """Signatures of the participants' tasks against every trained task's generated block, then W and F."""
        trained = self.trained_tasks()
        view = generate(self.pool, self.W, trained, None, trained, len(trained))
        msg = Message(
            {"powder/keys": view["prompt.rest_keys"], "powder/attention": view["prompt.rest_attention"]},
            {"trained": trained},
            kind="signature",
        )
        replies = grid.broadcast(info.participants, msg)
        space = self.env.label_space
        for k in sorted(replies):
            g = self.env.label_task(info.stage, k)
            sig, count = replies[k].tensors["powder/class_signature"], replies[k].tensors["powder/class_count"]
            if int(count.sum()) == 0:
                continue
            self.signatures[g] = (trained, sig[count > 0].mean(0))
            for c, logit in enumerate(space.tasks[g].logits):
                if count[c] > 0:
                    self.class_signatures[logit] = (trained, sig[c])
        p = self.params
        keys, rows = correlation(self.signatures, self.components, p.correlation_power)
        idx = torch.tensor(keys)
        self.W[idx.unsqueeze(1), idx.unsqueeze(0)] = rows
        owner = {logit: g for g in range(space.num_tasks) for logit in space.tasks[g].logits}
        group = {c: owner[c] for c in self.class_signatures}
        ckeys, crows = correlation(self.class_signatures, self.components, p.class_power, p.class_top_k, group)
        self.class_weight[torch.tensor(ckeys)] = 1 - crows.max(dim=1).values
        return {"powder_self_weight": float(rows.diagonal().mean()), "powder_tasks_correlated": float(len(keys))}

    # -------------------------------------------------------------------- protocol
    def reply_schema(self, message: Message) -> ReplySchema | None:
        if message.kind == "signature":
            width = len(message.scalars["trained"]) * self.components
            prompt: GeneratedTaskPrompt = self.model.prompt  # type: ignore[assignment]
            return ReplySchema(
                {
                    "powder/class_signature": TensorSpec(("C", len(prompt.layers), width), torch.float32),
                    "powder/class_count": TensorSpec(("C",), torch.long, low=0),
                },
                scalars={"num_samples": (int,)},
            )
        if message.kind != "train":
            return None
        state = self.model.state_dict()
        required = {k: TensorSpec.like(v) for k, v in state.items() if k.startswith(("head.", "prompt.own_"))}
        scalars: dict[str, tuple[type, ...]] = {"num_samples": (int,), "loss": (int, float)}
        return ReplySchema({**required, **self.reply_tensors()}, self.reply_groups(), scalars)

    def client_model(self, client: int, label_task: int | None = None) -> nn.Module:
        """Task g's own generated prompt with the global head: one model per (client, task), all in one reused
        object (valid until the next call)."""
        if label_task is None:
            return self.global_model()
        m = self.eval_model()  # the factory's model: top_k generated-block slots, as every task is served
        m.set_state(self.task_state(label_task))
        return m

    def model_key(self, client: int, label_task: int) -> int:
        return label_task

    def global_model(self) -> nn.Module:
        """The code's server-side view: every trained task's generated block, prompts divided by their number."""
        T = self.env.label_space.num_tasks
        if self._global is None:
            self._global = self.model_with_blocks(T)
        trained = self.trained_tasks()
        head = {k: v for k, v in self.model.get_state().items() if k.startswith("head.")}
        self._global.set_state({**generate(self.pool, self.W, trained, None, trained, T), **head})
        return self._global

    def state(self) -> Record:
        record = super().state()
        record.tensors.update({f"pool/{part}": t for part, t in self.pool.items()})
        record.tensors.update({"powder/W": self.W, "powder/drawn": self.drawn, "powder/trained": self.trained,
                               "powder/class_weight": self.class_weight})  # fmt: skip
        for prefix, sigs in (("sig/task/", self.signatures), ("sig/class/", self.class_signatures)):
            for key, (trained, vec) in sigs.items():
                record.tensors[f"{prefix}{key}"] = vec
                record.scalars[f"{prefix}{key}"] = list(trained)
        return record

    def load_state(self, state: Record) -> None:
        own = {k: v for k, v in state.tensors.items() if k.startswith(("head.", "prompt."))}
        super().load_state(Record(own))
        self.pool = {part: state.tensors[f"pool/{part}"].clone() for part in PARTS}
        self.W = state.tensors["powder/W"].clone()
        self.drawn = state.tensors["powder/drawn"].clone()
        self.trained = state.tensors["powder/trained"].clone()
        self.class_weight = state.tensors["powder/class_weight"].clone()
        self.signatures, self.class_signatures = {}, {}
        for prefix, sigs in (("sig/task/", self.signatures), ("sig/class/", self.class_signatures)):
            for name, vec in state.tensors.items():
                if name.startswith(prefix):
                    sigs[int(name[len(prefix) :])] = (list(state.scalars[name]), vec.clone())


register_method(
    "powder",
    PowderParams,
    PowderServer,
    PowderClient,
    build_model,
    "per-(client, task) CODA-P blocks; task-correlation-weighted prompt generation (forward/backward transfer), "
    "owner aggregation, not-true distillation",
    "Powder (ICML 2024)",
    scenario_kinds=("asynchronous",),
    signals=(prompt_mechanism,),
)
