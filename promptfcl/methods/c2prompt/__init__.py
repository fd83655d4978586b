"""C2Prompt: Class-aware Client Knowledge Interaction for Federated Continual Learning (arXiv 2509.19674).

No official code exists; this is built from the paper summary (`../shared/papers/000_…`), the framework figure and
a third-party note, on Powder's benchmark and Fed-CODAP base (`../shared/methods.md` §2). Every equation and every
choice where the sources are silent is listed here and in `docs/methods/c2prompt.md`.

Base (`base`, the one structural switch): `codap` (default; the implementation that predates Powder here and that
the existing evidence and tests cover) — CODA-P stage prompts per client, below — | `powder` — the paper's
pipeline ([N]: "C2Prompt = Powder/CODA-P pipeline + round-0 class-distribution estimation + LCDC + CPA; Powder's
distillation term kept"): Powder's per-(client, task) blocks of N = `components_per_stage` components, its
task-correlation prompt generation and owner aggregation, its not-true distillation (`ntd_weight` 1, Powder's
code) and its signature exchange at round 0 (`methods.powder`), with LCDC and CPA on top: the compensation prompts
and the histogram as below (H over the N components of the client's own block, α from its own keys and attention
vectors [I]), CPA mixing the K participants' own blocks (K·N rows per layer), each mixed block stored as its
task's block. `base: powder, lcdc: false, cpa: false` is `powder` with C2Prompt's prompt shape and optimiser
(`tests/test_c2prompt_powder.py` checks the logs are identical); `lcdc` / `cpa` alone give the paper's ablation
rows "Powder + LCDC" / "Powder + CPA". The default stays `codap` so no existing result silently changes; the
paper's reading is `base: powder` (`configs/papers/c2prompt/`).

Model (`base: codap`): CODA-P discriminative prompts (`prompts.codap.CodaPool`; N = 8 components of length 10
per stage in layers 0–4, α_m = cos(q(x) ⊙ A_m, K_m) with q(x) the unprompted frozen CLS, the stage's block
trainable and earlier blocks frozen) + a linear head over the per-(client, task) slots. Per stage t, for every
participant k:

Round 0 (`lcdc`, §4.2 Eq. 1–4):
1. Client: per real class i of its current task, (n_{i,k}, μ_{i,k}, σ²_{i,k}) of q(x) on its data.
2. Server: moment matching of the client mixture, μ^g_i = Σ_k p_{k,i} μ_{i,k}, σ^g_i² = Σ_k p_{k,i}(μ²_{i,k} +
   σ²_{i,k}) − μ^g_i², p_{k,i} = n_{i,k}/Σ_k n_{i,k} (`statistics.pooled`: the same identity with unbiased
   variances, i.e. exactly the pooled data's statistics); each client receives its classes' (μ^g, σ^g²).
3. Client: fresh compensation prompts (one per class, 3 input tokens after the patches) trained to minimise the
   diagonal-Gaussian NLL of the compensated feature (`training.compensation`), then frozen (client state). The
   round logs, averaged over clients on `lcdc_diagnostic_samples` samples each, the NLL under the global Gaussians
   of the unprompted q(x) (`lcdc_nll_unprompted`: what LCDC must beat), and of the compensated feature with the
   freshly initialised (`lcdc_nll_before`) and the trained prompts (`lcdc_nll_after`).
Rounds 1..N_r (§4.3): CE over the task's own slots (+ β·L_kd, below) with the label's frozen compensation prompt
appended to each sample with probability p = 0.5; the client accumulates H_k[l, m, c] = Σ_{x of real class c}
α^{(l)}_m(x) over the stage's N components of every prompted layer l. No compensation prompt at test time. Each
round logs the mean CE of the compensated and of the plain samples (`lcdc_ce_compensated`, `lcdc_ce_plain`): the
compensation prompt is picked by the label, so their gap measures how much of the label it hands the head.
Server CPA (§4.4 Eq. 10): per layer, stack the K·N stage components P and histograms H of all participants,
W = row-softmax(H Hᵀ / τ), P* = W P; client k receives its own N rows of P* (a client-specific downlink); keys
and attention vectors are mixed with the same W (our inference). Head rows are per-(client, task) slots, each
taken from the client that owns it (`federation.aggregation.owner_row_mean`). Evaluation uses each client's model
(metrics.json `scored_model: client`; Fed-CODAP is scored on the global model).

Benchmark switch (Powder's code vs the stated intent): `scenario.asynchronous.slice_rule` → `powder` (default, the
benchmark C2Prompt declares: slice (k·T + j) mod 5, so a class repeated at the same position of two clients'
sequences is trained on the same images) | `distinct` (every repeat of a class sees new images; see
`scenario.asynchronous`).

Choices where the sources are silent (switch → default):
- `lcdc_round`: "shared" (round 0 = statistics + LCDC, then discriminative training in the same round) | "extra"
  (round 0 only statistics + LCDC) → shared (methods.md's reading: the N_r = 3 rounds of Powder's stage).
- Statistics are keyed by *real* class (the benchmark gives every (client, task) its own slots, so only real
  classes are shared across clients); histogram columns are real classes for the same reason.
- Compensation prompts are re-drawn and re-trained at round 0 of every stage (they are P^c_{t,k}, per stage);
  `lcdc_epochs` 1, Adam `lcdc_lr` 0.01, variance floor ε = 1e-4, init N(0, 0.02²).
- p is drawn per sample (`compensation_prob` 0.5); the compensated and plain samples run as two sub-batches.
- H is accumulated over the round's local training and uploaded every round; per layer (each layer has its own
  keys and attention vectors, hence its own α); `histogram_norm` "centered_l2" (each component's class profile
  minus its client's mean profile, L2-normalised: W compares relative class affinities and a component is never
  averaged with its client's siblings just because they see the same class counts) | "l2" | "l1" (methods.md's
  guess) | "none"; τ = `cpa_temperature` 0.2 (studied in the paper, value not given).
- L_kd (`kd_weight` β, default 0: the CODA-P base specifies no distillation and Powder's β is not given): LwF-style
  KL (temperature `kd_temperature`) between the current and the received model's logits over the slots of the
  client's earlier tasks. With `base: powder`, Powder's own distillation term (not-true distillation, `ntd_weight`
  1 as in Powder's code, 0 turns it off) is added as well — the note's "Powder's distillation term kept".
- The global model (for `eval.model: global`) is the sample-weighted mean of the clients' prompts.
Ablations: `lcdc: false` (no statistics round, no compensation), `cpa: false` (FedAvg of prompts, keys and
attention vectors = Fed-CODAP); both off equals `fedcodap` with the same settings.
`codap_direct` is the single-task "direct" reference for FWT: every (client, task) trains its own fresh CODA-P
prompt (pool task 0) and head on its own data for the rounds it is scheduled, no federation.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from promptfcl.evaluation.validity import prompt_mechanism
from promptfcl.federation.aggregation import RunningMean, weighted_mean
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, Grid, MethodEnv, ReplyFold, RoundInfo, handles
from promptfcl.federation.validation import ReplySchema, TensorSpec
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import FedAvgServer, SupervisedClient, set_task
from promptfcl.methods.base.prompt_models import PoolTrainingParams, pooled_model
from promptfcl.methods.c2prompt.compensation_prompts import CompensationPrompts
from promptfcl.methods.c2prompt.compensation_training import train_compensation
from promptfcl.methods.c2prompt.cpa import class_affinity_weights, mix_rows
from promptfcl.methods.c2prompt.signals import check_cpa_mixes, check_lcdc, cpa_on, lcdc_on
from promptfcl.methods.powder import PowderClient, PowderKnobs, PowderServer, powder_model
from promptfcl.methods.powder.generated import PARTS
from promptfcl.model import PromptedClassifier
from promptfcl.prompts import CodaPool
from promptfcl.prompts.codap import attention_weights
from promptfcl.scenario.label_space import masked_logits
from promptfcl.seeding import torch_generator
from promptfcl.statistics import class_statistics, pooled, uploaded_statistics
from promptfcl.training.local import LossFn

POOL_TENSORS = ("prompt.prompts", "prompt.keys", "prompt.attention")
LCDC_METRICS = ("lcdc_nll_unprompted", "lcdc_nll_before", "lcdc_nll_after", "lcdc_ce_compensated", "lcdc_ce_plain")


class StageCodaParams(PoolTrainingParams):
    """CODA-P grown by `components_per_stage` per stage (C2Prompt: N = 8, length 10, layers 0–4; Adam lr 0.01)."""

    components_per_stage: int = Field(8, gt=0)
    length: int = Field(10, gt=0)
    layers: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4])
    ortho_mu: float = Field(0.0, ge=0)
    lr: float = Field(0.01, gt=0, description="C2Prompt note: Adam 0.01 (Powder's scripts: 0.005)")


class C2PromptParams(PowderKnobs, StageCodaParams):
    """LCDC, CPA, their ablation switches and the base (choices the sources leave open are in the module)."""

    base: Literal["codap", "powder"] = Field(
        "codap", description="codap: CODA-P stage prompts per client | powder: Powder's pipeline (the paper's base)"
    )
    lcdc: bool = True
    cpa: bool = True
    lcdc_round: Literal["shared", "extra"] = "shared"
    compensation_length: int = Field(3, gt=0)
    compensation_prob: float = Field(0.5, ge=0, le=1)
    lcdc_epochs: int = Field(1, gt=0)
    lcdc_lr: float = Field(0.01, gt=0)
    variance_eps: float = Field(1e-4, gt=0)
    lcdc_diagnostic_samples: int | None = Field(
        64,
        ge=0,
        description="samples on which the NLL of q(x) and of the compensated feature before/after LCDC is logged "
        "(None: all, 0: none)",
    )
    cpa_temperature: float = Field(0.2, gt=0)
    histogram_norm: Literal["centered_l2", "l2", "l1", "none"] = "centered_l2"
    kd_weight: float = Field(0.0, ge=0)
    kd_temperature: float = Field(2.0, gt=0)


def build_model(env: MethodEnv, p: StageCodaParams) -> PromptedClassifier:
    if getattr(p, "base", "codap") == "powder":
        return powder_model(env, p, p.components_per_stage, p.length, p.layers, p.top_k)  # type: ignore[attr-defined]
    n = env.num_stages
    pool = CodaPool(env.backbone.embed_dim, n, p.layers, p.components_per_stage * n, p.length, p.ortho_mu)
    return pooled_model(env, p, pool)


def stage_block(model: PromptedClassifier) -> tuple[int, int]:
    """[start, end) of the pool rows the current stage trains."""
    pool: CodaPool = model.prompt  # type: ignore[assignment]
    return pool.task * pool.per_task, (pool.task + 1) * pool.per_task


# ------------------------------------------------------------------------------- LCDC and CPA, base-independent
def lcdc_gaussians(grid: Grid, env: MethodEnv, info: RoundInfo) -> dict[int, dict[str, torch.Tensor]]:
    """Round 0: the participants' q(x) statistics go up; each gets the moment-matched Gaussians of its classes."""
    extra: dict[int, dict[str, torch.Tensor]] = {k: {} for k in info.participants}
    stats = uploaded_statistics(grid.broadcast(info.participants, Message(kind="stats")))
    if not stats:
        return extra
    glob = pooled(stats)
    pos = {c: i for i, c in enumerate(glob.classes.tolist())}
    for k in info.participants:
        mine = [c for c in env.label_space.tasks[env.label_task(info.stage, k)].classes if c in pos]
        rows = torch.tensor([pos[c] for c in mine], dtype=torch.long)
        extra[k] = {
            "lcdc/classes": torch.tensor(mine, dtype=torch.long),
            "lcdc/mean": glob.means[rows],
            "lcdc/var": glob.spread[rows],  # type: ignore[index]
        }
    return extra


def lcdc_metrics(replies: dict[int, Message]) -> dict[str, float]:
    """The clients' mean LCDC NLLs (q(x), fresh prompts, trained prompts) where the round logged them."""
    out = {}
    for key in LCDC_METRICS:
        vals = [r.scalars[key] for r in replies.values() if key in r.scalars]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def cpa_mix(
    blocks: list[dict[str, torch.Tensor]], hist: torch.Tensor, temperature: float, norm: str
) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
    """CPA: per layer, W = row-softmax(H Hᵀ/τ) over the K·N components of the K clients' blocks (each tensor
    (layers, N, …)); client k gets its N rows of W·P. Also how W mixes (means over rows and layers):
    `cpa_self_weight` (W's diagonal), `cpa_own_client_weight` (the share from the client's own N components; FedAvg
    gives 1/K) and `cpa_weight_entropy` (row entropy over log(K·N): 1 = uniform, 0 = no mixing)."""
    n = hist.shape[2]  # hist: (K, layers, N, classes)
    out = [{name: t.clone() for name, t in b.items()} for b in blocks]
    own = torch.block_diag(*[torch.ones(n, n, dtype=torch.float64)] * len(blocks))
    diag: dict[str, list[float]] = {"cpa_self_weight": [], "cpa_own_client_weight": [], "cpa_weight_entropy": []}
    for layer in range(hist.shape[1]):
        W = class_affinity_weights(hist[:, layer], temperature, norm)
        entropy = -(W * W.clamp_min(1e-300).log()).sum(1) / max(math.log(W.shape[0]), 1e-12)
        diag["cpa_self_weight"].append(W.diagonal().mean().item())
        diag["cpa_own_client_weight"].append((W * own).sum(1).mean().item())
        diag["cpa_weight_entropy"].append(entropy.mean().item())
        for name in blocks[0]:
            mixed = mix_rows(W, torch.cat([b[name][layer] for b in blocks]))
            for k in range(len(blocks)):
                out[k][name][layer] = mixed[k * n : (k + 1) * n]
    return out, {key: sum(v) / len(v) for key, v in diag.items()}


# ------------------------------------------------------------------------------------------- clients
@dataclass
class TrainingPass:
    """What one train message's local training accumulates as its loss runs: the CPA histogram H[l, m, c], the CE
    sums split by compensation (compensated sum, count, plain sum, count) and the received model (the KD
    teacher, when `kd_weight` > 0). Built per message, so nothing of it outlives the message."""

    hist: torch.Tensor
    teacher: nn.Module | None = None
    split: torch.Tensor = field(default_factory=lambda: torch.zeros(4, dtype=torch.float64))

    @torch.no_grad()
    def record_split_ce(self, logits: torch.Tensor, y: torch.Tensor, compensated: torch.Tensor) -> None:
        """Add the batch's CE, split by whether the sample carried its label's compensation prompt."""
        ce = F.cross_entropy(logits, y, reduction="none").double().cpu()
        c = compensated.cpu()
        self.split += torch.stack([ce[c].sum(), c.sum().double(), ce[~c].sum(), (~c).sum().double()])

    def split_ce(self) -> dict[str, float]:
        """The mean CE on compensated (`lcdc_ce_compensated`) and plain (`lcdc_ce_plain`) samples. The
        compensation prompt is chosen by the label and absent at test time: a compensated CE far below the plain
        one means it hands the head the label (a shortcut the test images do not have)."""
        s_c, n_c, s_p, n_p = self.split.tolist()
        if n_c == 0 or n_p == 0:
            return {}
        return {"lcdc_ce_compensated": s_c / n_c, "lcdc_ce_plain": s_p / n_p}


class C2PromptClient(SupervisedClient):
    """Statistics of q(x) (round 0), LCDC, discriminative training with compensation and the CPA histogram
    (`base: powder` uses `C2PromptPowderClient`: the same LCDC and histogram on Powder's generated prompt)."""

    @handles("stats")
    def handle_stats(self, message: Message, ctx: ClientContext) -> Message:
        return self.statistics(ctx)

    @handles("train")
    def handle_train(self, message: Message, ctx: ClientContext) -> Message:
        model = self.model
        model.set_state({k: message.tensors[k] for k in model.state_dict()})
        set_task(model, ctx.stage)
        stats: dict[str, float] = {}
        if "lcdc/mean" in message.tensors:
            stats.update(self.compensate(message, ctx))
        if not message.scalars.get("discriminative", True):
            return Message({}, {"num_samples": 0, "loss": 0.0, **stats}, kind="train_reply")
        run = TrainingPass(
            torch.zeros(*self.histogram_shape(model), self.env.label_space.num_real_classes),
            copy.deepcopy(model).eval() if self.params.kd_weight > 0 else None,
        )
        loss = self.training_loss(message, ctx, run) if len(ctx.train_data) else None
        stats.update(self.train(model, ctx, message, loss))
        stats.update(run.split_ce())
        reply = self.reply(model, ctx, stats)
        reply.tensors["cpa/hist"] = run.hist
        reply.scalars.update({k: v for k, v in stats.items() if k.startswith("lcdc")})
        return reply

    # ----------------------------------------------------------------------------------------- round 0
    def statistics(self, ctx: ClientContext) -> Message:
        """(count, mean, diagonal variance) of q(x) per real class of the current task."""
        st = class_statistics(self.env.backbone.query, ctx.train_data, self.env.eval_transform, ctx.device, "diag", 2)
        st.classes = self.env.label_space.logit_to_class()[st.classes]
        return Message(st.to_tensors(), {"num_samples": len(ctx.train_data)}, kind="stats_reply")

    def compensate(self, message: Message, ctx: ClientContext) -> dict[str, float]:
        """Fresh compensation prompts for the task's classes, fitted to the global Gaussians, stored frozen."""
        p, space = self.params, self.env.label_space
        task = space.tasks[ctx.label_task]
        first = task.logits[0]
        real = {int(c): i for i, c in enumerate(message.tensors["lcdc/classes"].tolist())}
        rows = torch.tensor([real.get(c, -1) for c in task.classes])
        index_of = torch.full((space.num_logits,), -1, dtype=torch.long)
        has = rows >= 0
        index_of[torch.tensor(task.logits)[has]] = torch.arange(len(task.classes))[has]
        dim = self.env.backbone.embed_dim
        mean, var = torch.zeros(len(task.classes), dim), torch.ones(len(task.classes), dim)
        mean[has] = message.tensors["lcdc/mean"][rows[has]].float()
        var[has] = message.tensors["lcdc/var"][rows[has]].float()
        gen = torch_generator(ctx.seed, "lcdc")
        prompts = CompensationPrompts(len(task.classes), p.compensation_length, dim, gen).to(ctx.device)
        out = train_compensation(
            self.env.backbone, prompts, ctx.train_data, index_of, mean, var, self.env.eval_transform,
            p.lcdc_epochs, p.lcdc_lr, p.batch_size, gen, ctx.device, p.variance_eps, p.lcdc_diagnostic_samples,
        )  # fmt: skip
        ctx.state.tensors["lcdc/prompts"] = prompts.tokens.detach().cpu()
        ctx.state.scalars.update(lcdc_stage=ctx.stage, lcdc_first_logit=first)
        return out

    # ------------------------------------------------------------------------------- rounds 1..N_r
    def extra_terms(self, message: Message, ctx: ClientContext) -> list:
        """The base's own loss terms, (x, y, logits) → loss (CODA-P: none; Powder: its distillation)."""
        return []

    def training_loss(self, message: Message, ctx: ClientContext, run: TrainingPass) -> LossFn:
        """CE over the task's slots with the label's compensation prompt on a random half of the samples (+ KD,
        + the base's own terms); records the histogram and the CE split into `run` as it goes."""
        p, space, backbone = self.params, self.env.label_space, self.env.backbone
        comp = None
        if p.lcdc and ctx.state.scalars.get("lcdc_stage") == ctx.stage and "lcdc/prompts" in ctx.state.tensors:
            comp = CompensationPrompts(1, 1, 1)
            comp.tokens = nn.Parameter(ctx.state.tensors["lcdc/prompts"].to(ctx.device), requires_grad=False)
            first = int(ctx.state.scalars["lcdc_first_logit"])
        real_of = space.logit_to_class().to(ctx.device)
        coin = torch_generator(ctx.seed, "compensation")
        old = [g for g in self.learned_tasks(ctx) if g != ctx.label_task]
        old_mask = space.mask([j for g in old for j in space.tasks[g].logits]).to(ctx.device) if old else None
        terms = self.extra_terms(message, ctx)

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            q = backbone.query(x)
            spec = model.prompt(len(x), q)
            use = torch.zeros(len(x), dtype=torch.bool)
            if comp is not None and p.compensation_prob > 0:
                use = torch.rand(len(x), generator=coin) < p.compensation_prob
            use = use.to(x.device)
            feats = torch.empty(len(x), backbone.embed_dim, device=x.device)
            if (~use).any():
                rows = (~use).nonzero().flatten()
                feats[rows] = backbone(x[rows], spec.select(rows, len(x)))
            if use.any():
                rows = use.nonzero().flatten()
                extra = comp.spec(y[rows] - first)  # type: ignore[union-attr]
                feats[rows] = backbone(x[rows], spec.select(rows, len(x)).merge(extra))
            logits = model.head(feats)
            total = F.cross_entropy(masked_logits(logits, mask), y) + model.prompt.aux_loss
            if comp is not None:
                run.record_split_ce(masked_logits(logits, mask), y, use)
            if run.teacher is not None and old_mask is not None:
                with torch.no_grad():
                    t_logits = run.teacher(x)
                T = p.kd_temperature
                s_log = F.log_softmax(masked_logits(logits, old_mask) / T, dim=1)[:, old_mask]
                t_prob = F.softmax(masked_logits(t_logits, old_mask) / T, dim=1)[:, old_mask]
                total = total + p.kd_weight * T * T * F.kl_div(s_log, t_prob, reduction="batchmean")
            for term in terms:
                total = total + term(x, y, logits)
            self.accumulate(run.hist, model, q, real_of[y])
            return total

        return loss

    def histogram_shape(self, model: PromptedClassifier) -> tuple[int, int]:
        """(prompted layers, components) of the histogram: the current stage's block."""
        pool: CodaPool = model.prompt  # type: ignore[assignment]
        return len(pool.layers), pool.per_task

    def component_weights(self, model: PromptedClassifier, q: torch.Tensor, layer: int) -> torch.Tensor:
        """α (B, N) of the components the histogram counts: the stage block's."""
        s, f = stage_block(model)
        return model.prompt.component_weights(q, layer)[:, s:f]  # type: ignore[operator]

    @torch.no_grad()
    def accumulate(self, hist: torch.Tensor, model: PromptedClassifier, q: torch.Tensor, real: torch.Tensor) -> None:
        """H[l, m, c] += Σ α^{(l)}_m(x) over the batch's samples of real class c (the histogram's components)."""
        for i in range(hist.shape[0]):
            hist[i].index_add_(1, real.cpu(), self.component_weights(model, q, i).cpu().T)

    def learned_tasks(self, ctx: ClientContext) -> list[int]:
        """Label-space tasks this client has trained, in order (kept in its state)."""
        learned = list(ctx.state.scalars.get("learned_tasks", []))
        if ctx.label_task not in learned:
            learned.append(ctx.label_task)
            ctx.state.scalars["learned_tasks"] = learned
        return learned


class C2PromptPowderClient(C2PromptClient, PowderClient):
    """C2Prompt on Powder's base: Powder's signature and distillation, LCDC and the histogram of the own block."""

    def extra_terms(self, message: Message, ctx: ClientContext) -> list:
        ntd = self.ntd_term(message, ctx)
        return [] if ntd is None else [ntd]

    def histogram_shape(self, model: PromptedClassifier) -> tuple[int, int]:
        own = model.prompt.own_keys  # type: ignore[union-attr]
        return own.shape[0], own.shape[1]

    def component_weights(self, model: PromptedClassifier, q: torch.Tensor, layer: int) -> torch.Tensor:
        """α (B, N) of the client's own block (its own keys and attention vectors) [I]."""
        pr = model.prompt
        return attention_weights(q, pr.own_keys[layer], pr.own_attention[layer])  # type: ignore[index]


# ------------------------------------------------------------------------------------------- servers
class C2PromptServer(FedAvgServer):
    """Moment-matched class Gaussians at round 0; CPA (or FedAvg) of the stage's components per client
    (`base: powder` uses `C2PromptPowderServer`: Powder's task pool, generation and aggregation)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pools: dict[int, dict[str, torch.Tensor]] = {}  # client → its pool (created from the global one)
        self.gaussians: dict[int, dict[str, torch.Tensor]] = {}  # this round's LCDC Gaussians per participant

    def begin_stage(self, task: int) -> None:
        super().begin_stage(task)  # the global pool draws the stage's block (once)
        g = self.model.get_state()
        for state in self.pools.values():  # every client starts the stage's block from the same draw
            if int(state["prompt.initialized_tasks"]) <= task:
                for n in (*POOL_TENSORS, "prompt.initialized_tasks"):
                    state[n] = g[n].clone()

    def client_state(self, k: int, g: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Client k's pool (the global one until it first takes part) with the global head (`g`: the global state,
        shared by every client's message of a round rather than copied per client)."""
        g = self.model.get_state() if g is None else g
        if k not in self.pools:
            self.pools[k] = {n: t.clone() for n, t in g.items() if n.startswith("prompt.")}
        return {**g, **self.pools[k]}

    def before_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """Round 0 (`lcdc`): the participants' class statistics, moment-matched into global class Gaussians."""
        p = self.params
        self.gaussians = lcdc_gaussians(grid, self.env, info) if p.lcdc and info.round == 0 else {}
        return {}

    def configure(self, info: RoundInfo) -> dict[int, Message]:
        """Each participant's own pool with the global head (and its classes' Gaussians at round 0)."""
        p = self.params
        discriminative = not (p.lcdc and info.round == 0 and p.lcdc_round == "extra")
        g = self.model.get_state()
        return {
            k: Message({**self.client_state(k, g), **self.gaussians.get(k, {})}, {"discriminative": discriminative},
                       kind="train")
            for k in info.participants
        }  # fmt: skip

    def reply_fold(self) -> ReplyFold:
        return self._keep_stage_block

    def reply_metrics(self, replies: dict[int, Message]) -> dict[str, float]:
        return lcdc_metrics(replies)

    def _keep_stage_block(self, client: int, reply: Message) -> Message:
        """Fold of a train reply as it arrives: of the pool tensors keep only the stage's block of rows (the only
        rows a client trains: earlier blocks are frozen, later ones unused), so a round holds one block per client,
        not every client's whole pool."""
        s, f = stage_block(self.model)
        tensors = {n: t[:, s:f].clone() if n in POOL_TENSORS else t for n, t in reply.tensors.items()}
        return Message(tensors, reply.scalars, kind=reply.kind)

    def aggregate(self, replies: dict[int, Message]) -> dict[str, float]:
        """The stage block of each participant's pool: CPA-mixed per client (or their mean for every client with
        `cpa: false`); the global pool is the mean of the participants' pools, the head owner-row averaged.
        Returns how CPA mixed (`cpa_mix`)."""
        p = self.params
        weights = [r.scalars["num_samples"] for r in replies.values()] if p.weighting == "samples" else None
        previous = self.model.get_state()
        head = self.owned_head(previous, replies, weights)
        for k in replies:
            self.client_state(k)  # a participant's pool exists (from the global one) before its block is written
        diagnostics: dict[str, float] = {}
        if p.cpa:
            blocks, diagnostics = self.class_aware(replies)
        else:
            mean = weighted_mean([{n: r.tensors[n] for n in POOL_TENSORS} for r in replies.values()], weights)
            blocks = {k: mean for k in self.pools}
        s, f = stage_block(self.model)
        for k, block in blocks.items():
            for name, t in block.items():
                self.pools[k][name][:, s:f] = t
        mean_pool = RunningMean()  # the global view: mean of the participants' prompts (no list of their pools)
        for k, w in zip(replies, weights or [1.0] * len(replies), strict=True):
            mean_pool.add(self.pools[k], w)
        pool = mean_pool.result()
        pool["prompt.initialized_tasks"] = previous["prompt.initialized_tasks"]
        self.model.set_state({**previous, **pool, **head})
        return diagnostics

    def class_aware(self, replies: dict[int, Message]) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, float]]:
        """CPA over the participants' stage blocks (`cpa_mix`): client k's mixed block of rows."""
        p = self.params
        clients = list(replies)
        blocks = [{name: replies[k].tensors[name] for name in POOL_TENSORS} for k in clients]
        hist = torch.stack([replies[k].tensors["cpa/hist"] for k in clients])  # (K, layers, N, classes)
        mixed, diagnostics = cpa_mix(blocks, hist, p.cpa_temperature, p.histogram_norm)
        return dict(zip(clients, mixed, strict=True)), diagnostics

    def client_model(self, client: int, label_task: int | None = None) -> nn.Module:
        """Client k's CPA model, in one object reused for every client (valid until the next call)."""
        m = self.eval_model()
        m.load_state_dict(self.client_state(client), assign=True)  # the held pool's own tensors: no second copy
        m.prompt.set_task(self.model.prompt.task)
        return m

    def model_key(self, client: int, label_task: int) -> int:
        return client

    def state(self) -> Record:
        record = super().state()
        for k, pool in self.pools.items():
            record.tensors.update({f"client{k}/{n}": t for n, t in pool.items()})
        return record

    def load_state(self, state: Record) -> None:
        own = {n: t for n, t in state.tensors.items() if not n.startswith("client")}
        super().load_state(Record(own, state.scalars))
        self.pools = {}
        for n, t in state.tensors.items():
            if n.startswith("client"):
                k, name = n[len("client") :].split("/", 1)
                self.pools.setdefault(int(k), {})[name] = t


class C2PromptPowderServer(PowderServer):
    """C2Prompt on Powder's base: LCDC's Gaussians at round 0; CPA mixes the participants' own blocks before each
    mixed block replaces its task's block (`cpa: false`: Powder's owner aggregation)."""

    def round_extras(
        self, grid: Grid, info: RoundInfo
    ) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, object]]:
        p = self.params
        extra = lcdc_gaussians(grid, self.env, info) if p.lcdc and info.round == 0 else {}
        return extra, {"discriminative": not (p.lcdc and info.round == 0 and p.lcdc_round == "extra")}

    def reply_metrics(self, replies: dict[int, Message]) -> dict[str, float]:
        return lcdc_metrics(replies)

    def absorb(self, replies: dict[int, Message], labels: dict[int, int]) -> dict[str, float]:
        p = self.params
        if not p.cpa:
            return super().absorb(replies, labels)
        clients = list(replies)
        blocks = [{part: replies[k].tensors[f"prompt.own_{part}"] for part in PARTS} for k in clients]
        hist = torch.stack([replies[k].tensors["cpa/hist"] for k in clients])
        mixed, diagnostics = cpa_mix(blocks, hist, p.cpa_temperature, p.histogram_norm)
        self.store_blocks({labels[k]: block for k, block in zip(clients, mixed, strict=True)})
        previous = self.model.get_state()
        weights = [r.scalars["num_samples"] for r in replies.values()] if p.weighting == "samples" else None
        self.model.set_state({**previous, **self.owned_head(previous, replies, weights)})
        return diagnostics

    def reply_schema(self, message: Message) -> ReplySchema | None:
        if message.kind == "train" and not message.scalars.get("discriminative", True):
            return ReplySchema(scalars={"num_samples": (int,)})  # an LCDC-only round uploads no parameters
        return super().reply_schema(message)

    def reply_tensors(self) -> dict[str, TensorSpec]:
        own = self.model.prompt.own_keys  # type: ignore[union-attr]
        shape = (own.shape[0], own.shape[1], self.env.label_space.num_real_classes)
        return {"cpa/hist": TensorSpec(shape, torch.float32)}


class DirectClient(SupervisedClient):
    """Single-task training: the pool always serves task 0 (one fresh block, no earlier knowledge)."""

    def pool_task(self, ctx: ClientContext) -> int:
        return 0


class DirectServer(FedAvgServer):
    """No federation: each (client, task) trains its own model, started fresh when the client starts the task."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.initial = self.model.get_state()
        self.tasks: dict[int, dict[str, torch.Tensor]] = {}

    def begin_stage(self, task: int) -> None:
        self.model.prompt.set_task(0)

    def configure(self, info: RoundInfo) -> dict[int, Message]:
        """Each participant gets its current (client, task)'s own model (fresh at its first round)."""
        return {
            k: Message(self.tasks.get(self.env.label_task(info.stage, k), self.initial), kind="train")
            for k in info.participants
        }

    def aggregate(self, replies: dict[int, Message]) -> None:
        """No federation: each trained reply becomes its (client, task)'s model."""
        names = self.initial.keys()
        for k, r in replies.items():
            self.tasks[self.env.label_task(self.round_info.stage, k)] = {n: r.tensors[n] for n in names}

    def client_model(self, client: int, label_task: int | None = None) -> nn.Module:
        """Task g's own model, in one object reused for every task (valid until the next call)."""
        g = -1 if label_task is None else label_task
        m = self.eval_model()
        m.load_state_dict(self.tasks.get(g, self.initial), assign=True)  # the held state's own tensors: no copy
        m.prompt.set_task(0)
        return m

    def model_key(self, client: int, label_task: int) -> int:
        return label_task

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """Every (client, task)'s own model (the global one is never trained)."""
        return {f"task{g}/{n}": t for g, st in self.tasks.items() for n, t in st.items()}

    def state(self) -> Record:
        record = Record({f"init/{n}": t for n, t in self.initial.items()})
        for g, st in self.tasks.items():
            record.tensors.update({f"task{g}/{n}": t for n, t in st.items()})
        return record

    def load_state(self, state: Record) -> None:
        self.initial = {n[5:]: t for n, t in state.tensors.items() if n.startswith("init/")}
        self.tasks = {}
        for n, t in state.tensors.items():
            if n.startswith("task"):
                g, name = n[4:].split("/", 1)
                self.tasks.setdefault(int(g), {})[name] = t


register_method(
    "c2prompt",
    C2PromptParams,
    C2PromptServer,
    C2PromptClient,
    build_model,
    "CODA-P (or, base: powder, Powder's) prompts with LCDC compensation prompts and class-aware (per-client) "
    "prompt aggregation",
    "C2Prompt (arXiv 2509.19674)",
    builds_on=("powder",),
    variant=lambda p: (C2PromptPowderServer, C2PromptPowderClient) if p.base == "powder" else None,
    signals=(lcdc_on, cpa_on, check_lcdc, check_cpa_mixes, prompt_mechanism),
)
register_method(
    "codap_direct",
    StageCodaParams,
    DirectServer,
    DirectClient,
    build_model,
    "direct single-task reference for FWT: a fresh CODA-P prompt + head per (client, task), no federation",
    "Powder's *_direct runs",
    signals=(prompt_mechanism,),
)
