"""FedMGP: personalized FCL with multi-granularity prompts (Yu et al., "Personalized Federated Continual Learning
via Multi-granularity Prompt", KDD'24; Algorithm 1).

Per round, on every participating client i (its own task sequence, `scenario.kind: personalized`):
1. **Coarse global prompts** (§4.1, Eq. 3–6): an L2P pool P_g (M = 10 prompts of length 10, keys K_g) selected
   top-N (3, the official CIFAR-100 config) by cosine between the *unprompted* frozen feature V(x) and the keys,
   inserted as input tokens before the patches; trained with the client's global head H_g by CE over the current
   task's classes (other logits −inf) plus the pull constraint λ1 (Eq. 6). Then frozen.
2. **Fine local prompts** (§4.2, Eq. 7–10): one prefix prompt per class with separate K and V tensors (length
   10) in layers 2–4 (`ClassPrefixPool`), on top of the frozen global prompts; chosen by the label in training
   and by cosine between the global-prompted query V(x') and the local keys at test; trained with the local head
   of the current task (one head per task, kept by the client) by CE over the task's classes plus λ2 · pull.
3. Upload **only the global pool and keys** (plus the client's current class ids, as the official server reads
   them to build the proxy set).
On the server, **selective prompt fusion** (§4.3, Eq. 11): optionally drop clients whose global prompt + head
score ≤ `filter_threshold` on the proxy images of their classes, then distil the kept pools into one student
pool (initialised from the first kept client's, as the code) by Σ_teachers MSE between the backbone's output
token sequences under student and teacher prompts, on a proxy set of `proxy_per_class` = 20 images per class of
the clients' current classes from data no client holds (the test split: in personalized scenarios clients hold
only train-split images). The fused pool is broadcast to every client for the next round (and evaluation).
Local prompts and heads never leave the client and live only in `ctx.state` (no shared model object).
Evaluation: the `client_local` regime (fused global prompts + the client's local prompts + the local head of
the evaluated task, logits masked to that task's classes). Each evaluation also reports `diag/local_key_hit`,
the % of a client's current-task local test images whose own class's local prompt (the one training used) is
among those selected at test time, and `diag/local_key_chance`, the % a uniformly random choice would hit
(100·min(k, C)/C: k = `local_top_k` prompts among the C candidate class prompts of `local_select`): a hit rate
near chance means the local keys do not route test images, the first thing to look at when FedMGP trails FedL2P.

Paper vs official code (SkyOfBeginning/FedMGP @ fca3643) — paper defaults, code behind switches:
- pool 10 / length 10 / lr 1e-3 / λ 0.1 (paper, CIFAR-100 config) vs pool 20, top-4, lr 1.5e-3, λ 0.5 (the
  `five_datasets_delay` config `main.py` actually loads): `pool_size`, `top_k`, `lr`, `pull_coef`.
- task-partitioned selection masks (`use_prompt_mask`): `task_partition` (off); batch-wise voting (the code's
  `batchwise_prompt`, which makes test predictions depend on the batch): `batchwise_voting` (off).
- proxy = 20 images per class (paper, `surrogate_num`) vs the whole test split of those classes (code bug):
  `proxy: full_test`. The code feeds the proxy with train-time augmentation; here the evaluation transform.
- the fused global head: code trains it (CE on the proxy with the fused prompts) and discards it; the paper
  keeps each client's own H_g: `return_fused_head` (off; on = trained and sent back). The accuracy filter is
  commented out in the code: `filter_threshold` (None = off; needs clients to upload their global head).
- local selection at test: code top-k (= global top-k) with batch-wise voting over all 100 keys; here top-1
  (training always uses the one prompt of the label) among the classes the client has learned
  (`local_top_k`, `local_batchwise`, `local_select: seen | task | all`).
- weight decay: code Adam(wd 1e-3) on whole pool tensors (unused prompts decay every step, methods.md §3.9.6);
  paper states plain Adam: `weight_decay` 0 (set 1e-3 for the code's drift). Fresh optimizer per phase per round.
- local keys' lr: the paper trains everything with one Adam lr. The keys get gradient only from λ2's pull term,
  so Adam moves them about lr per step whatever λ2 is, and at a small step budget they route test images at chance
  (benchmarks/fedmgp_key_budget.py: what matters is lr × steps). `local_key_lr` gives them their own lr (None:
  `lr`, the paper); prompts, heads and the global phase are unaffected (the keys take no part in their gradients
  in training, where the prompt is chosen by the label).
- head: code MLP d→512→ReLU→C on the mean of the global-prompt token outputs (`head_type='prompt'`); the paper
  does not say: same as the code by default (`head`, `readout`).
Ablations (paper §5.3): `global_prompt: false` (w/o global prompt), `local_prompt: false` (w/o local prompt;
the client is tested with global prompts + its H_g), `fusion: fedavg` (uniform average instead of distillation,
the code's `fed_avg`).
- w/o global prompt — what is still shared. The paper removes the global prompts and says no more (§5.3, Fig. 3);
  the official code has no such switch. Our reading: the local prompts and their keys become the shared prompts.
  Each client uploads its local pool (and its current classes); the server averages each class's prompt and key
  over the clients whose current task holds the class (`owner_row_mean`, uniform as the code's `fed_avg`; rows
  nobody trained keep their value) and broadcasts the pool, which the client trains from and is tested with;
  per-task local heads stay personal (heads never travel in FedMGP). Without global prompts there is no phase 1
  and no H_g, the local query is the unprompted V(x), and heads read CLS (there are no prompt tokens). Why this
  reading: Table 1 reports w/o GP as "the aggregated global model" and Fig. 3(a) gives it its own spatial
  retention KR_s (global over local model), which needs shared parameters inside the evaluated model; the local
  prompts are the only prompts left; and §4 argues that aggregating fine-grained knowledge is what causes spatial
  forgetting, which this ablation then measures. SPF distillation (Eq. 11) is defined for input-token prompts
  chosen by key, not class-indexed prefixes, so `fusion` does not apply here.
- `local_only: true` — a control, not a paper row: no tensor is uploaded or broadcast, each client trains
  its prompts and heads alone (with `global_prompt: true` its global prompts are never fused), so KR_s is 100 by
  construction. Before release 0.1.0 this was what `global_prompt: false` ran; `global_prompt: false` +
  `local_only: true` reproduces it.

Deviations (all methods.md §3.9 bugs not reproduced): every client builds its own model from its own state (no
shared ViT object, so a new task's local head is fresh, not the previous client's); the local test split uses the
evaluation transform; no positional embedding on the global prompt tokens (the project's L2P; the official code
interpolates the positional table over the prompt positions); the pull constraint is the project's
mean(1 − cos) form, so `pull_coef` λ is applied as λ·top_k to the L2P pool to equal the code's Σ_k-cos strength;
the distillation loss averages the MSE over elements per teacher (the code sums; Adam is scale-invariant) and
uses `fusion_epochs` epochs (code: `local_epoch`).

Speed (no change to the algorithm): with `query_cache: true` the unprompted q(x) and the global-prompted V(x')
(phase 2's pull query and the test-time local selection, computed with the global prompts frozen) are cached per
exact input — an image and its flip — and V(x') also per global-pool state (`MGPModel.vx_version`), so phase 2
computes it once per image variant instead of every epoch, and a new round's prompts never see stale entries.
"""

from __future__ import annotations

import copy
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from promptfcl.backbones.query_cache import QueryCache
from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import Augment
from promptfcl.evaluation.client_local import Predict, evaluate_reply, remember_local
from promptfcl.evaluation.validity import parameter_moves
from promptfcl.federation.aggregation import owner_row_mean, weighted_mean
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import (
    ClientContext,
    ClientProgram,
    MethodEnv,
    RoundInfo,
    handles,
)
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import RoundServer, loss_scalars
from promptfcl.methods.base.prompt_models import check_layers
from promptfcl.methods.fedmgp.class_prefix import ClassPrefixPool
from promptfcl.methods.fedmgp.model import (
    GLOBAL_HEAD,
    GLOBAL_POOL,
    LOCAL_POOL,
    HeadKind,
    MGPModel,
    Readout,
    distill_pool,
    key_chance,
    key_hits,
    subset_state,
)
from promptfcl.methods.fedmgp.signals import check_key_hit, local_prompts_on
from promptfcl.prompts.l2p import L2PPool
from promptfcl.scenario.label_space import masked_logits
from promptfcl.seeding import numpy_rng, torch_generator
from promptfcl.training.local import LocalTrainingParams, LossTerms, make_optimizer, train_local


class FedMGPParams(LocalTrainingParams):
    """FedMGP hyper-parameters: paper defaults; the official code's values are in the module docstring."""

    lr: float = Field(1e-3, gt=0, description="Adam, both phases and the fusion (paper 1e-3; code 1.5e-3)")
    local_epochs: int = Field(5, gt=0, description="epochs of each phase per round")
    batch_size: int = Field(16, gt=0)
    augment: Augment = Field(
        "crop_flip",
        description="training augmentation: none | flip | crop_flip (flip + a reflection-padded translation) | "
        "rrc_flip (RandomResizedCrop + flip, as the official fed-mammoth / HePCo codes)",
    )
    # coarse global prompts (L2P)
    pool_size: int = Field(10, gt=0)
    length: int = Field(10, gt=0)
    top_k: int = Field(3, gt=0)
    pull_coef: float = Field(0.1, ge=0, description="λ1 (code's Σ_k-cos scale)")
    batchwise_voting: bool = False
    task_partition: int | None = Field(None, gt=0, description="code's use_prompt_mask: prompts per task")
    head: HeadKind = "mlp"
    head_hidden: int = Field(512, gt=0)
    readout: Readout = "prompt_mean"
    # fine local prompts
    local_layers: list[int] = Field(default_factory=lambda: [2, 3, 4])
    local_length: int = Field(10, gt=0)
    local_pull_coef: float = Field(0.1, ge=0, description="λ2")
    local_key_lr: float | None = Field(
        None, gt=0, description="Adam lr of the local keys (None: `lr`, the paper); they learn from λ2 alone"
    )
    local_top_k: int = Field(1, gt=0)
    local_batchwise: bool = False
    local_select: Literal["seen", "task", "all"] = "seen"
    # server: selective prompt fusion
    fusion: Literal["distill", "fedavg"] = "distill"
    proxy: Literal["per_class", "full_test"] = "per_class"
    proxy_per_class: int = Field(20, gt=0)
    fusion_epochs: int = Field(5, gt=0)
    filter_threshold: float | None = Field(None, ge=0, lt=1, description="drop clients with proxy accuracy ≤ this")
    return_fused_head: bool = False
    # ablations and controls
    global_prompt: bool = Field(True, description="false: §5.3 w/o global prompt (the local prompts are shared)")
    local_prompt: bool = True
    local_only: bool = Field(False, description="control, not a paper row: nothing is communicated")
    query_cache: bool = Field(
        False, description="cache q(x) and phase 2's V(x') per exact input (use with augment: none or flip)"
    )

    @model_validator(mode="after")
    def _fixed_by_the_paper(self) -> FedMGPParams:
        if self.optimizer_reset != "round":
            raise ValueError("FedMGP makes a fresh optimizer for each phase of each round: remove optimizer_reset")
        if self.train_logits != "current_task":
            raise ValueError("FedMGP trains on the current task's classes only (Eq. 6, 10): remove train_logits")
        if not (self.global_prompt or self.local_prompt):
            raise ValueError("FedMGP without global and local prompts is FedViT; keep one of them")
        if self.uploads_head() and (self.local_only or not self.global_prompt):
            why = "local_only sends nothing" if self.local_only else "without global prompts there is no H_g"
            raise ValueError(f"{why}: remove filter_threshold / return_fused_head")
        return self

    def uploads_head(self) -> bool:
        return self.filter_threshold is not None or self.return_fused_head

    def shared(self) -> tuple[str, ...]:
        """State prefixes that travel: the global pool; the local pool in the w/o-global ablation; none when
        `local_only`. Everything else lives only in the client's state."""
        if self.local_only:
            return ()
        return (GLOBAL_POOL,) if self.global_prompt else (LOCAL_POOL,)


def build_model(env: MethodEnv, p: FedMGPParams) -> MGPModel:
    check_layers(env, p.local_layers)
    env.backbone.enable_query_cache(p.query_cache)
    d, space = env.backbone.embed_dim, env.label_space
    pool = None
    if p.global_prompt:
        pool = L2PPool(
            d, p.pool_size, p.length, p.top_k, "tokens", (0,), p.pull_coef * p.top_k, p.batchwise_voting,
            p.task_partition,
        )  # fmt: skip
    local = ClassPrefixPool(d, space.num_logits, p.local_layers, p.local_length) if p.local_prompt else None
    return MGPModel(env.backbone, space.num_logits, space.num_tasks, pool, local, p.head, p.head_hidden, p.readout)


def _ce(logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(masked_logits(logits, mask), y)


class FedMGPClient(ClientProgram):
    """One round = phase 1 (global prompts + H_g) then phase 2 (local prompts + the task's local head)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        p = self.params
        # V(x'), phase 2's query under the frozen global prompts, cached per (image, flip) and global-prompt state
        # like q(x) (same switch); batch-wise voting makes it depend on the batch, so it is not cached then
        self.vx_cache = QueryCache() if p.query_cache and not p.batchwise_voting else None

    def _model(self, message: Message, ctx: ClientContext) -> MGPModel:
        """This client's model: shared tensors from the message, personal ones from its own state."""
        model: MGPModel = self.new_model()  # fresh per message: nothing is shared between clients
        shared = self.params.shared()
        own = {k: v for k, v in ctx.state.tensors.items() if not k.startswith(shared)}
        model.load_state_dict(own, strict=False)
        sent = {k: v for k, v in message.tensors.items() if k.startswith(shared)}
        sent.update({GLOBAL_HEAD + k[len("fused_head.") :]: v for k, v in message.tensors.items()
                     if k.startswith("fused_head.")})  # fmt: skip
        model.load_state_dict(sent, strict=False)
        if model.global_pool is not None:
            model.global_pool.set_task(ctx.stage)
        model.vx_cache = self.vx_cache
        return model.to(ctx.device)

    def local_candidates(self, ctx: ClientContext, task: int) -> torch.Tensor | None:
        """Bool mask of the local prompts a test image of `task` may select (`local_select`); None: every one."""
        space = ctx.space(self.env)
        if self.params.local_select == "task":
            return space.mask(space.tasks[task].logits)
        if self.params.local_select == "seen":
            return space.seen_mask(max(task, ctx.stage))
        return None

    def predict(self, model: MGPModel, ctx: ClientContext) -> Predict:
        """Evaluating task t: the local prompts chosen by key among `local_candidates` + the local head of t."""
        p = self.params
        if model.local_pool is None:
            return lambda x, task: model(x)

        def local(x: torch.Tensor, task: int) -> torch.Tensor:
            allowed = self.local_candidates(ctx, task)
            return model.local_logits(x, task, None, allowed, p.local_top_k, p.local_batchwise)

        return local

    @handles("evaluate")
    def handle_evaluate(self, message: Message, ctx: ClientContext) -> Message:
        model = self._model(message, ctx)
        model.eval()
        batch = int(message.scalars.get("batch_size", 256))
        return evaluate_reply(self.predict(model, ctx), ctx, self.env, message, self.diagnostics(model, ctx, batch))

    @handles("train")
    def handle_train(self, message: Message, ctx: ClientContext) -> Message:
        model = self._model(message, ctx)
        model.eval()
        p, space = self.params, ctx.space(self.env)
        mask = space.train_mask(ctx.stage, "current_task")
        tf = self.env.train_transform(p.augment)
        before = self.private_trained(model)
        losses, final = [], {}
        if len(ctx.train_data) and model.global_pool is not None:  # phase 1: coarse global prompts + H_g
            self._trainable(model, ["global_pool", "global_head"])

            def global_loss(m: MGPModel, x: torch.Tensor, y: torch.Tensor, mk: torch.Tensor) -> LossTerms:
                ce = _ce(m(x), y, mk)
                return LossTerms(ce + m.global_pool.aux_loss, ce)

            stats = train_local(model, ctx.train_data, p, mask, tf, torch_generator(ctx.seed, "global"), ctx.device,
                                global_loss)  # fmt: skip
            losses.append(stats["loss"])
            final = stats
        if len(ctx.train_data) and model.local_pool is not None:  # phase 2: fine local prompts, global frozen
            self._trainable(model, ["local_pool", f"local_heads.{ctx.stage}."])
            pull = p.local_pull_coef > 0

            def local_loss(m: MGPModel, x: torch.Tensor, y: torch.Tensor, mk: torch.Tensor) -> LossTerms:
                ce = _ce(m.local_logits(x, ctx.stage, labels=y, pull=pull), y, mk)
                return LossTerms(ce + p.local_pull_coef * m.local_aux, ce)

            stats = train_local(model, ctx.train_data, p, mask, tf, torch_generator(ctx.seed, "local"), ctx.device,
                                local_loss, self._local_optimizer(model))  # fmt: skip
            losses.append(stats["loss"])
            final = stats  # the phase whose head is evaluated: its final-epoch loss is the validity gate's
        self._trainable(model, [])
        remember_local(self.predict(model, ctx), ctx, self.env, message)
        ctx.state.tensors = {k: v.detach().clone() for k, v in model.state_dict().items()
                             if not k.startswith(p.shared())}  # fmt: skip
        upload = {k: v for prefix in p.shared() for k, v in subset_state(model, prefix).items()}
        if p.uploads_head():
            upload.update(subset_state(model, GLOBAL_HEAD))
        scalars = {
            "num_samples": len(ctx.train_data),
            **loss_scalars(final),
            "loss": sum(losses) / len(losses) if losses else 0.0,  # the mean over both phases
            "classes": list(space.tasks[ctx.stage].classes),
            **parameter_moves(before, self.private_trained(model)),
        }
        return Message(upload, scalars, kind="train_reply")

    def private_trained(self, model: MGPModel) -> dict[str, torch.Tensor]:
        """A copy of the trained parameters this client keeps to itself (its H_g, its local prompts and keys, its
        per-task local heads; not what it uploads): their moves go up in the reply (`move/<group>`), since the
        server, which the experiment loop measures, never holds them."""
        trained = ([GLOBAL_HEAD] if model.global_pool is not None else []) + (
            [LOCAL_POOL, "local_heads."] if model.local_pool is not None else []
        )
        shared = self.params.shared()
        return {k: q.detach().clone() for k, q in model.named_parameters()
                if k.startswith(tuple(trained)) and not k.startswith(shared)}  # fmt: skip

    @torch.no_grad()
    def diagnostics(self, model: MGPModel, ctx: ClientContext, batch_size: int = 256) -> dict[str, float]:
        """The train/test selection gap of §4.2.2 on the current task's local test images, selected exactly as
        `predict` does (`local_top_k` among `local_candidates`, `local_batchwise`, batches of the evaluation's
        size): `local_key_hit`, the % whose own class's local prompt (the one training used) is among the
        selected; `local_key_chance`, the % a uniformly random choice of as many candidates would hit,
        100·min(k, C)/C for C candidate class prompts (the image's own class is always a candidate)."""
        if model.local_pool is None or ctx.local_test is None:
            return {}
        p, hits, n = self.params, 0, 0
        allowed = self.local_candidates(ctx, ctx.stage)
        batch = nograd_batch(ctx.device, batch_size)
        for x, y in ctx.local_test(ctx.stage).batches(batch, self.env.eval_transform, device=ctx.device):
            ids = model.local_pool.select(model.local_query(x), allowed, p.local_top_k, p.local_batchwise)
            hits += key_hits(ids, y)
            n += len(y)
        if not n:
            return {}
        candidates = int(allowed.sum()) if allowed is not None else model.local_pool.keys.shape[0]
        return {"local_key_hit": 100.0 * hits / n, "local_key_chance": key_chance(p.local_top_k, candidates)}

    def _local_optimizer(self, model: MGPModel) -> torch.optim.Optimizer | None:
        """Phase 2's optimizer when the local keys have their own lr (`local_key_lr`); None: train_local's own."""
        p = self.params
        if p.local_key_lr is None:
            return None
        keys = model.local_pool.keys
        rest = [q for q in model.parameters() if q.requires_grad and q is not keys]
        return make_optimizer(p, [{"params": rest}, {"params": [keys], "lr": p.local_key_lr}])

    @staticmethod
    def _trainable(model: MGPModel, prefixes: list[str]) -> None:
        for name, q in model.named_parameters():
            q.requires_grad_(any(name.startswith(pre) for pre in prefixes))


class FedMGPServer(RoundServer):
    """Broadcasts the fused global pool; fuses the clients' pools by distillation (or FedAvg) on proxy data."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # seeds "model_init" and builds the model
        self.model: MGPModel
        self.has_fused_head = False

    def begin_stage(self, task: int) -> None:
        if self.model.global_pool is not None:
            self.model.global_pool.start_task(task)

    def shared(self) -> dict[str, torch.Tensor]:
        """What every client receives: the fused global pool (and the fused head when it is returned); in the
        w/o-global ablation the per-class averaged local pool; nothing when `local_only`."""
        out = {k: v for prefix in self.params.shared() for k, v in subset_state(self.model, prefix).items()}
        if self.params.return_fused_head and self.has_fused_head:
            head = subset_state(self.model, GLOBAL_HEAD)
            out.update({"fused_head." + k[len(GLOBAL_HEAD) :]: v for k, v in head.items()})
        return out

    def evaluate_message(self) -> Message:
        return Message(self.shared(), kind="evaluate")

    def downlink(self, info: RoundInfo) -> Message:
        return Message(self.shared(), kind="train")

    def aggregate(self, replies: dict[int, Message]) -> dict[str, float]:
        """Fuse the clients' global pools (FedMGP), or average their local pools per class (w/o global)."""
        if self.params.shared() == (GLOBAL_POOL,):
            return self.fuse(replies, self.round_info)
        if self.params.shared() == (LOCAL_POOL,):
            return self.share_local(replies)
        return {}

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """What the server itself changes: the fused shared pool, and H_g when the fused head is returned (the
        clients' own heads and local prompts report their moves in their replies)."""
        out = {k: v for prefix in self.params.shared() for k, v in subset_state(self.model, prefix).items()}
        if self.params.return_fused_head:
            out.update(subset_state(self.model, GLOBAL_HEAD))
        return out

    def share_local(self, replies: dict[int, Message]) -> dict[str, float]:
        """W/o global prompt (§5.3): each class's local prompt and key averaged over the clients whose current
        task holds the class (the ones that trained that row this round); rows nobody trained keep their value."""
        space, pool = self.env.label_space, self.model.local_pool
        rows = [[int(space.class_to_logit[c]) for c in r.scalars["classes"]] for r in replies.values()]
        fused = {}
        for name, dim in pool.CLASS_DIM.items():
            values = [r.tensors[LOCAL_POOL + name].movedim(dim, 0) for r in replies.values()]
            fused[name] = owner_row_mean(getattr(pool, name).detach().movedim(dim, 0), values, rows).movedim(0, dim)
        pool.load_state_dict(fused)
        return {"shared_local_rows": len({j for r in rows for j in r})}

    # ---------------------------------------------------------------------------- selective fusion
    def proxy(self, classes: set[int]) -> LabeledSubset:
        """The server's proxy images of `classes`: `proxy_per_class` fixed images per class of the test split."""
        split = self.env.server_split
        if split is None:
            raise ValueError("FedMGP's server needs proxy data no client holds: use scenario.kind: personalized")
        targets = split.targets.numpy()
        idx = []
        for c in sorted(classes):
            pos = np.flatnonzero(targets == c)
            if self.params.proxy == "per_class":
                pos = numpy_rng(self.env.seed, "fedmgp_proxy", c).permutation(pos)[: self.params.proxy_per_class]
                pos = np.sort(pos)
            idx.append(pos)
        return LabeledSubset.of(split, np.concatenate(idx), self.env.label_space.class_to_logit)

    def _pool(self, state: dict[str, torch.Tensor]) -> L2PPool:
        pool = copy.deepcopy(self.model.global_pool)
        pool.load_state_dict({k[len(GLOBAL_POOL) :]: v for k, v in state.items() if k.startswith(GLOBAL_POOL)})
        return pool

    @torch.no_grad()
    def proxy_accuracy(self, reply: Message) -> float:
        """A client's global prompts + uploaded H_g on the proxy images of its current classes (the filter)."""
        model = copy.deepcopy(self.model)
        model.load_state_dict({k: v for k, v in reply.tensors.items() if k.startswith((GLOBAL_POOL, GLOBAL_HEAD))},
                              strict=False)  # fmt: skip
        model.eval()
        classes = reply.scalars["classes"]
        data = self.proxy(set(classes))
        mask = self.env.label_space.mask([int(self.env.label_space.class_to_logit[c]) for c in classes])
        correct = 0
        batch = nograd_batch(self.env.device, self.params.batch_size)
        for x, y in data.batches(batch, self.env.eval_transform, device=self.env.device):
            correct += int((masked_logits(model(x), mask).argmax(1) == y).sum())
        return correct / max(len(data), 1)

    def fuse(self, replies: dict[int, Message], info: RoundInfo) -> dict[str, float]:
        p, env = self.params, self.env
        chosen = list(replies)
        out: dict[str, float] = {}
        if p.filter_threshold is not None:
            kept = [c for c in chosen if self.proxy_accuracy(replies[c]) > p.filter_threshold]
            out["filtered_out"] = len(chosen) - len(kept)
            chosen = kept or chosen  # nobody passes: fall back to every client
        states = [replies[c].tensors for c in chosen]
        if p.fusion == "fedavg" or len(chosen) == 1:
            names = [k for k in states[0] if k.startswith(GLOBAL_POOL)]
            fused = weighted_mean([{k: s[k] for k in names} for s in states])
            self.model.load_state_dict(fused, strict=False)
        else:
            classes = {c for k in chosen for c in replies[k].scalars["classes"]}
            proxy = self.proxy(classes)
            student, teachers = self._pool(states[0]), [self._pool(s) for s in states[1:]]
            gen = torch_generator(env.seed, "fedmgp", info.stage, info.round)
            losses = distill_pool(student, teachers, env.backbone, proxy, env.eval_transform, p.fusion_epochs,
                                  p.batch_size, p.lr, p.weight_decay, gen, env.device)  # fmt: skip
            self.model.global_pool.load_state_dict(student.state_dict())
            out.update({"fusion_loss_first": losses[0], "fusion_loss_last": losses[-1], "proxy_images": len(proxy)})
        if p.return_fused_head:
            classes = {c for k in chosen for c in replies[k].scalars["classes"]}
            out["head_loss"] = self.fuse_head(replies[chosen[0]], classes, info)
        return out

    def fuse_head(self, first: Message, classes: set[int], info: RoundInfo) -> float:
        """The code's head fusion: the first kept client's H_g trained by CE on the proxy with the fused prompts."""
        p, env, model = self.params, self.env, self.model
        model.global_head.load_state_dict({k[len(GLOBAL_HEAD) :]: v for k, v in first.tensors.items()
                                           if k.startswith(GLOBAL_HEAD)})  # fmt: skip
        for name, q in model.named_parameters():
            q.requires_grad_(name.startswith(GLOBAL_HEAD))
        mask = env.label_space.mask([int(env.label_space.class_to_logit[c]) for c in classes])
        stats = train_local(
            model, self.proxy(classes), p.model_copy(update={"local_epochs": p.fusion_epochs}), mask,
            env.eval_transform, torch_generator(env.seed, "fedmgp_head", info.stage, info.round), env.device,
            lambda m, x, y, mk: _ce(m(x), y, mk),
        )  # fmt: skip
        for q in model.parameters():
            q.requires_grad_(False)
        self.has_fused_head = True
        return stats["loss"]

    def global_model(self) -> torch.nn.Module:
        return self.model

    def state(self) -> Record:
        tensors = subset_state(self.model, GLOBAL_POOL)
        tensors.update(subset_state(self.model, GLOBAL_HEAD))
        if LOCAL_POOL in self.params.shared():
            tensors.update(subset_state(self.model, LOCAL_POOL))
        return Record(tensors, {"has_fused_head": self.has_fused_head})

    def load_state(self, state: Record) -> None:
        self.model.load_state_dict(state.tensors, strict=False)
        self.has_fused_head = bool(state.scalars.get("has_fused_head", False))


register_method(
    "fedmgp",
    FedMGPParams,
    FedMGPServer,
    FedMGPClient,
    build_model,
    "coarse global L2P prompts fused on the server by distillation + fine class-wise local prefix prompts and "
    "per-task heads kept on each client (personalized FCL)",
    "FedMGP (KDD 2024)",
    scenario_kinds=("personalized",),
    signals=(local_prompts_on, check_key_hit),
)
