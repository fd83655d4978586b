"""LoRM: Closed-form merging of parameter-efficient modules for Federated Continual Learning.

Salami, Buzzega, Mosconi, Bonato, Sabetta, Calderara, ICLR 2025 (arXiv 2410.17961), with the official code
(aimagelab/fed-mammoth `_models/lorm.py` on `_models/lora_pre.py` + `_models/regmean.py`). The paper's body was
not available to us: [P] marks its abstract, [N] secondary summaries of it, [C] the official code, [H] the HGP
paper's Appendix H (same authors, LoRM run as a competitor), [I] our inference where all are silent.

Algorithm (per task t, rounds r = 0..R−1):
1. Server, start of task: a fresh LoRA module per adapted projection, A_t Kaiming-uniform, B_t = 0 [C]. Every
   block's qkv, attn.proj, mlp.fc1, mlp.fc2 is adapted [C]; ΔW = B·A (rank 16 [C]; LoRA's α unused, scale 1 [C]).
2. Clients train ONE factor per round, alternating, B first (round 0: B, round 1: A, ...) [P abstract][C], plus
   the linear head, with CE over the current task's logits (task-specific head slices [N][C]). The training
   forward is W0 + B_t·A_t only: each task's module is learned from the pre-trained weights [C].
3. Clients upload the trained factor, the head and the Gram matrices of the inputs of every adapted projection
   and of the head, computed in one no-grad pass on their task data with the trained module [C]; RegMean's
   regularisation G ← γ·G + (1−γ)·diag(G) is applied on the client, γ_backbone = 0 (only the diagonal)
   and γ_head = 0.5 [H: γ = (0, 0.5), CUB-200 (0, 0.3); N: "only diagonal elements of the Gram matrices"].
4. Server merges in closed form (RegMean solved for one unknown) [P][C]: B rounds, A shared:
   B* = (Σ_k B_k·A·G_k·Aᵀ)(A·(Σ_k G_k)·Aᵀ)⁺; A rounds, B shared: A* = (Σ_k A_k·G_k)(Σ_k G_k)⁺; head weight
   W* = (Σ_k W_k·H_k)(Σ_k H_k)⁺, bias sample-weighted FedAvg [C]. float64, pseudo-inverse [C].
5. End of task: clients recompute the Grams G_{t,k} on their task data with the merged module; the server merges
   the tasks' full residual weights with RegMean [N: "applying its formulation directly to the full residual
   weights"][C]: ΔW* = (Σ_{τ≤t} B_τ·A_τ·G_τ)(Σ_{τ≤t} G_τ)⁺, G_τ = Σ_k G_{τ,k}. The evaluated model is
   W0 + ΔW* with the head. ΔW* is kept low-rank: [B_1 … B_t]·[A_1·G_1; …; A_t·G_t]·(Σ G_τ)⁺ (rank ≤ t·r).

Switches (→ default, and why):
- `gram_decay_backbone` 0.0 [H][N] | 0.5 (the code's default `alpha_regmean_backbone = alpha_regmean_head`).
- `gram_model`: "current" (Grams under W0 + this task's module, RegMean's definition of each candidate's
  inputs) [I] | "running_mean" (the code: W0 + (Σ_{τ<t} B_τA_τ + B·A)/(t+1), its "filler" evaluation model,
  which needs the previous tasks' factors sent down) → "current"; the paper's choice is unknown to us.
- `train_matrix`: "alternate" (LoRM) | "A" | "B" (the code's ablations: one factor only, averaged the same way).
- `gram_upload_dtype`: float32 (the code's default `gram_dtype`) | float64. Grams are accumulated in float64.
- `gram_images`: "eval" (the evaluation transform: each Gram a fixed function of the client's data, RegMean's
  definition of a layer's inputs) | "train" (the code: `RegMean.end_round_client` applies the training
  augmentation `self.augment` in the Gram pass; here the client's `augment`, drawn from its own seeded generator)
  → "eval": the paper is silent [I], and the eval transform keeps the merge free of augmentation noise; set
  "train" (with `augment: rrc_flip`, the code's RandomResizedCrop + flip) to match the code.
- `gram_passes`: passes over the data per Gram (the code's `regmean_rounds`: 1 by default and in the CIFAR-100
  commands, 2 in every other released command) → 1. With `gram_images: eval` every pass adds the same Gram, so
  the merges do not change (every Gram is scaled alike); with "train" each pass sees other augmentations.
- `head_solve`: "inverse" (the code's head merge, `torch.inverse(Σ_k H_k)`, and RegMean's closed form as written)
  | "pinv" (a pseudo-inverse: directions no client's features reach get 0 instead of failing) → "inverse", as
  both sources have it; with γ_head > 0 the summed head Gram is positive definite whenever every feature
  dimension varies, and the two agree to float64 rounding. A singular sum stops the run with a message naming
  `pinv` (the code would fail there too). The factor and task merges use a pseudo-inverse in the code and here.
- `lr_a`, `lr_b`: the factor's own lr in its rounds, the head keeping `lr` (the code's `--lr_A`, `--lr_B`, set
  by its CUB-200, Cars-196 and ImageNet-A commands) → null (both factors at `lr`, as the CIFAR-100 commands).
- `weight_decay`: 0.0 (every command of the code's README, `--wd_reg=0`, the settings behind the paper's tables)
  | 0.1 (the code's argparse default `wd_reg`, used by no released command; AdamW then decays the whole head, so
  older tasks' rows shrink a little every step) → 0.0: the paper does not state it (nor does [H]), and the
  released commands that reproduce its numbers set 0.
- `round_eval` (what `every_round` evaluation sees before a task's end): "merged" (the previous tasks' merge with
  the current head; the current module joins at the task's end) [I] | "running_mean" (the code's "filler",
  W0 + (Σ_{τ<t} B_τA_τ + B_t·A_t)/(t+1), `_models/lorm.py:170-173`) → merged: the paper evaluates after each
  task only. Task-end accuracies (the accuracy matrix, FAA) are the same either way.
Hyper-parameters: AdamW lr 3e-4, no gradient clipping, batch 16, 5 local epochs, 5 rounds per task [C][N]; [H]
gives per-setting lr / rank (CIFAR-100 β 0.5: 3e-4 / 1, 0.1: 1e-4 / 16, 0.05: 5e-4 / 16).
Communication (what travels, counted by the Grid): down A, B, head (+ previous factors for "running_mean");
up the trained factor, head, the head Gram (d×d) and each adapted projection's Gram — its diagonal (n,) when
γ_backbone = 0 (the code ships the full n×n matrix with zeroed off-diagonals; the merge is identical); the
end-of-task exchange adds a second down/up of the module and the Grams, in the task's last round.
Deviations: robust aggregation rules and norm screening are not offered (closed-form merge).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from promptfcl.adapters.lora import FixedDeltas, LoRAAdapter, Site, lora_spec, site_key, site_weight
from promptfcl.backbones.prompt_spec import LORA_TARGETS, LoRADelta
from promptfcl.backbones.vit import stem_cache_for
from promptfcl.evaluation.validity import prompt_mechanism
from promptfcl.federation.aggregation import weighted_mean
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, Grid, MethodEnv, RoundInfo, handles
from promptfcl.federation.validation import ReplySchema, TensorSpec
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import RoundServer, SupervisedClient, loss_scalars
from promptfcl.methods.lorm.gram import input_grams
from promptfcl.methods.lorm.regmean import project_gram, regmean, regularize_gram
from promptfcl.model import PromptedClassifier
from promptfcl.seeding import torch_generator
from promptfcl.training.local import LocalTrainingParams

GRAM = "gram/"
OLD = "old/"
PAST = "past/"


class LoRMParams(LocalTrainingParams):
    """LoRM defaults (official code; γ from the HGP paper's Appendix H)."""

    optimizer: Literal["adam", "adamw", "sgd"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW weight decay: 0 in every released command (--wd_reg=0); the code's default 0.1"
    )
    lr_a: float | None = Field(None, ge=0, description="lr of the A factor in its rounds (the code's --lr_A; null: lr)")
    lr_b: float | None = Field(None, ge=0, description="lr of the B factor in its rounds (the code's --lr_B; null: lr)")
    grad_clip: float | None = Field(None, gt=0)
    rank: int = Field(16, ge=1, description="LoRA rank r of every adapted projection")
    layers: list[int] | None = Field(
        None,
        description="blocks to adapt (null: all; []: none, LoRM's head alone merged by RegMean - a control that "
        "ablates its adapters for a whole run, not a paper row)",
    )
    targets: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), description="projections to adapt")
    lora_scale: float = Field(1.0, gt=0, description="ΔW = scale·B·A")
    train_matrix: Literal["alternate", "A", "B"] = "alternate"
    gram_decay_backbone: float = Field(0.0, ge=0, le=1, description="γ for the adapted projections' Grams")
    gram_decay_head: float = Field(0.5, ge=0, le=1, description="γ for the head's Gram")
    gram_model: Literal["current", "running_mean"] = Field(
        "current", description="Grams under W0 + this task's module, or the code's running mean of all tasks' modules"
    )
    gram_upload_dtype: Literal["float32", "float64"] = "float32"
    gram_images: Literal["eval", "train"] = Field(
        "eval", description="Grams on eval-transformed images, or through the training augmentation (the code)"
    )
    gram_passes: int = Field(1, ge=1, description="passes over the data per Gram (the code's regmean_rounds)")
    head_solve: Literal["inverse", "pinv"] = Field(
        "inverse", description="head merge (Σ W_k H_k)(Σ H_k)^-1 with an inverse (code, RegMean) or a pseudo-inverse"
    )
    weighting: Literal["samples", "uniform"] = Field("samples", description="FedAvg weights of the head bias")
    round_eval: Literal["merged", "running_mean"] = Field(
        "merged",
        description="model evaluated before a task's end: the previous tasks' merge (+ head) or the code's "
        "running mean of every task's module, the current one included",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LoRMParams:
        if self.optimizer_reset != "round":
            raise ValueError(
                "LoRM trains a different factor every round, so its optimizer cannot carry over: "
                "set optimizer_reset: round"
            )
        return self


def build_model(env: MethodEnv, p: LoRMParams) -> PromptedClassifier:
    adapter = LoRAAdapter(env.backbone, p.layers, p.targets, p.rank, p.lora_scale)
    return PromptedClassifier(env.backbone, env.label_space.num_logits, adapter)


def trained_factor(p: LoRMParams, rnd: int) -> str:
    """The factor trained and merged in round `rnd` of a task: B, A, B, ... (alternate) or always one."""
    if p.train_matrix != "alternate":
        return p.train_matrix
    return "B" if rnd % 2 == 0 else "A"


def factor_names(model: PromptedClassifier, factor: str) -> list[str]:
    return [k for k in model.state_dict() if k.startswith(f"prompt.{factor.lower()}.")]


def old_factor_tensors(past: list[dict[str, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The previous tasks' (A_τ, B_τ) as message tensors `old/<τ>/<a|b>/<site>` (running-mean Grams only)."""
    return {f"{OLD}{t}/{f}/{k}": v for t, task in enumerate(past) for f in ("a", "b") for k, v in task[f].items()}


def running_mean_deltas(
    current: dict[Site, LoRADelta], old: list[dict[str, dict[str, torch.Tensor]]], scale: float
) -> dict[Site, LoRADelta]:
    """The code's "filler" model (`_models/lorm.py`): per site (Σ_{τ<t} s·B_τA_τ + the current delta) / (t + 1),
    `old[τ]` holding task τ's factors as {"a": {site key: A_τ}, "b": {site key: B_τ}}."""
    out = {}
    for s, total in current.items():
        for task in old:
            total = total.plus(LoRADelta(task["a"][site_key(s)], task["b"][site_key(s)], scale))
        out[s] = LoRADelta(total.a, total.b, 1.0 / (len(old) + 1))
    return out


class LoRMClient(SupervisedClient):
    """Trains the round's factor and the head, then uploads them with the Gram matrices of its data."""

    @handles("gram")
    def handle_gram(self, message: Message, ctx: ClientContext) -> Message:
        """End of task: the Gram matrices of the task's data through the received model."""
        model = self.model
        model.set_state({k: message.tensors[k] for k in model.state_dict()})
        return Message(self.grams(model, message, ctx), {"num_samples": len(ctx.train_data)}, kind="gram_reply")

    @handles("train")
    def handle_train(self, message: Message, ctx: ClientContext) -> Message:
        model = self.model
        model.set_state({k: message.tensors[k] for k in model.state_dict()})
        factor = str(message.scalars["factor"])
        model.prompt.set_trainable(factor)
        stats = self.train(model, ctx, message)
        model.prompt.set_trainable("both")
        state = model.get_state()
        out = {k: state[k] for k in factor_names(model, factor) + ["head.weight", "head.bias"]}
        out.update(self.grams(model, message, ctx))
        return Message(out, {"num_samples": len(ctx.train_data), **loss_scalars(stats)}, kind="train_reply")

    def param_groups(
        self, model: torch.nn.Module, ctx: ClientContext, message: Message
    ) -> list[torch.nn.Parameter] | list[dict]:
        """The round's factor at `lr_a` / `lr_b` when set, the head at `lr` (the code's two param groups)."""
        p = self.params
        lr = p.lr_b if str(message.scalars["factor"]) == "B" else p.lr_a
        factor = [q for q in model.prompt.parameters() if q.requires_grad]
        rest = [q for n, q in model.named_parameters() if q.requires_grad and not n.startswith("prompt.")]
        return factor + rest if lr is None else [{"params": factor, "lr": lr}, {"params": rest}]

    def grams(self, model: PromptedClassifier, message: Message, ctx: ClientContext) -> dict[str, torch.Tensor]:
        """The regularised Gram of every adapted projection's inputs (diagonal when γ = 0) and of the head's."""
        p, backbone = self.params, self.env.backbone
        sites: list[Site] = model.prompt.sites
        dtype = torch.float32 if p.gram_upload_dtype == "float32" else torch.float64
        diagonal = p.gram_decay_backbone == 0
        if len(ctx.train_data) == 0:  # nothing to summarise: zero Grams keep the reply's shape
            d = backbone.embed_dim
            out = {}
            for s in sites:
                n = site_weight(backbone, s).weight.shape[1]
                out[GRAM + site_key(s)] = torch.zeros((n,) if diagonal else (n, n), dtype=dtype)
            return {**out, GRAM + "head": torch.zeros(d, d, dtype=dtype)}
        spec = model.prompt()
        if p.gram_model == "running_mean" and ctx.stage > 0:  # the code's "filler": mean of all tasks' deltas
            keys = [site_key(s) for s in sites]
            old = [
                {f: {k: message.tensors[f"{OLD}{i}/{f}/{k}"] for k in keys} for f in ("a", "b")}
                for i in range(ctx.stage)
            ]
            spec = lora_spec(running_mean_deltas(model.prompt.deltas(), old, p.lora_scale))
        modules = {site_key(s): site_weight(backbone, s) for s in sites}
        if p.gram_images == "train":  # the code: the training augmentation, from this message's own generator
            transform, gen = self.env.train_transform(p.augment), torch_generator(ctx.seed, "gram")
        else:
            transform, gen = self.env.eval_transform, None
        with stem_cache_for(backbone, transform):  # augmented Grams: random crops never repeat, the stem runs batched
            grams, head = input_grams(
                lambda x: backbone(x, spec), modules, ctx.train_data, transform, ctx.device, diagonal,
                generator=gen, passes=p.gram_passes,
            )  # fmt: skip
        out = {GRAM + k: regularize_gram(g, p.gram_decay_backbone).to(dtype) for k, g in grams.items()}
        assert head is not None
        out[GRAM + "head"] = regularize_gram(head, p.gram_decay_head).to(dtype)
        return out


class LoRMServer(RoundServer):
    """Alternating closed-form merges across clients; RegMean of the tasks' residual weights across tasks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.task_started = -1
        # per completed task: {"a": {site: A_τ}, "b": {site: B_τ}, "ag": {site: A_τ·G_τ}}; running Σ_τ G_τ
        self.past: list[dict[str, dict[str, torch.Tensor]]] = []
        self.gram_sum: dict[str, torch.Tensor] = {}
        self._eval: nn.Module | None = None

    @property
    def adapter(self) -> LoRAAdapter:
        return self.model.prompt

    def begin_stage(self, task: int) -> None:
        if task != self.task_started:  # idempotent on resume: the module of a started task is kept
            self.adapter.reset(torch_generator(self.env.seed, "lorm", "init", task))
            self.task_started = task
            self._eval = None

    def downlink(self, info: RoundInfo) -> Message:
        tensors = self.model.get_state()
        if self.params.gram_model == "running_mean":
            tensors.update(old_factor_tensors(self.past))
        return Message(tensors, {"factor": trained_factor(self.params, info.round)}, kind="train")

    def aggregate(self, replies: dict[int, Message]) -> None:
        self.merge_clients(replies, trained_factor(self.params, self.round_info.round))

    def after_round(self, grid: Grid, info: RoundInfo, metrics: dict[str, float]) -> dict[str, float]:
        """After the task's last round: the Gram exchange and the across-task merge."""
        if info.round == self.env.rounds_per_task - 1:
            return self.merge_task(grid, info)
        return {}

    def merge_clients(self, replies: dict[int, Message], factor: str) -> None:
        """Step 4: the trained factor and the head weight by closed form, the head bias by FedAvg."""
        state = self.model.get_state()
        grams = {k: [r.tensors[GRAM + k] for r in replies.values()] for k in map(site_key, self.adapter.sites)}
        for key in self.adapter.sites:
            k = site_key(key)
            name = f"prompt.{factor.lower()}.{k}"
            ws = [r.tensors[name] for r in replies.values()]
            if factor == "A":  # B shared: A* = (Σ A_k G_k)(Σ G_k)⁺
                state[name] = regmean(ws, grams[k])
            else:  # A shared: B* = (Σ B_k A G_k Aᵀ)(A (Σ G_k) Aᵀ)⁺
                a = state[f"prompt.a.{k}"]
                state[name] = regmean(ws, [project_gram(a, g) for g in grams[k]])
        heads = [r.tensors[GRAM + "head"] for r in replies.values()]
        state["head.weight"] = regmean(
            [r.tensors["head.weight"] for r in replies.values()], heads, solve=self.params.head_solve
        )
        weights = [r.scalars["num_samples"] for r in replies.values()] if self.params.weighting == "samples" else None
        state["head.bias"] = weighted_mean([{"b": r.tensors["head.bias"]} for r in replies.values()], weights)["b"]
        self.model.set_state(state)
        self._eval = None

    def merge_task(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        """Step 5: Grams of the task's data under the merged module, then RegMean across tasks."""
        msg = Message(self.model.get_state(), kind="gram")
        if self.params.gram_model == "running_mean":
            msg.tensors.update(old_factor_tensors(self.past))
        replies = grid.broadcast(info.participants, msg)
        usable = [r for c, r in sorted(replies.items()) if r.scalars.get("num_samples", 0) > 0]
        if not usable:
            return {"task_merged": 0}
        state = self.model.get_state()
        task: dict[str, dict[str, torch.Tensor]] = {"a": {}, "b": {}, "ag": {}}
        for s in self.adapter.sites:
            k = site_key(s)
            g = torch.stack([r.tensors[GRAM + k].double() for r in usable]).sum(0)
            a = state[f"prompt.a.{k}"].to(g.device, torch.float64)  # solved where the Grams are (the CPU)
            task["a"][k], task["b"][k] = state[f"prompt.a.{k}"].clone(), state[f"prompt.b.{k}"].clone()
            task["ag"][k] = a * g if g.dim() == 1 else a @ g
            self.gram_sum[k] = g if k not in self.gram_sum else self.gram_sum[k] + g
        self.past.append(task)
        self._eval = None
        return {"task_merged": 1}

    def merged_deltas(self) -> dict[Site, LoRADelta]:
        """ΔW* = [s·B_1 … s·B_t]·([A_1G_1; …; A_tG_t]·(Σ G_τ)⁺) per site, float32."""
        out = {}
        for s in self.adapter.sites:
            k = site_key(s)
            g = self.gram_sum[k]
            b = torch.cat([t["b"][k].to(g.device, torch.float64) for t in self.past], dim=1) * self.params.lora_scale
            ag = torch.cat([t["ag"][k] for t in self.past], dim=0)
            if g.dim() == 1:
                a = ag * torch.where(g > 0, 1.0 / g.clamp_min(1e-300), torch.zeros_like(g))
            else:
                a = ag @ torch.linalg.pinv(g, hermitian=True)
            dev = self.env.device
            out[s] = LoRADelta(a.to(dev, torch.float32), b.to(dev, torch.float32))
        return out

    def trained_tensors(self) -> dict[str, torch.Tensor]:
        """The task's module and the head under training (the evaluated model holds the merged deltas instead)."""
        return self.model.get_state()

    def global_model(self) -> nn.Module:
        """After a task's end: W0 + the RegMean merge of every task so far, with the head. Before it (every-round
        evaluation): the previous tasks' merge (`round_eval: merged`), or the code's filler (`running_mean`)."""
        if not self.past:
            return self.model
        if self._eval is None:
            mid_task = len(self.past) <= self.task_started  # the current task's module is not merged yet
            if mid_task and self.params.round_eval == "running_mean":
                deltas = running_mean_deltas(self.adapter.deltas(), self.past, self.params.lora_scale)
            else:
                deltas = self.merged_deltas()
            model = PromptedClassifier(self.env.backbone, self.env.label_space.num_logits, None)
            model.prompt = FixedDeltas(deltas)
            model.head = self.model.head
            self._eval = model.to(self.env.device)
        return self._eval

    def reply_schema(self, message: Message) -> ReplySchema | None:
        backbone, sites = self.env.backbone, self.adapter.sites
        dtype = torch.float32 if self.params.gram_upload_dtype == "float32" else torch.float64
        grams = {}
        for s in sites:
            n = int(site_weight(backbone, s).weight.shape[1])
            shape = (n,) if self.params.gram_decay_backbone == 0 else (n, n)
            grams[GRAM + site_key(s)] = TensorSpec(shape, dtype)
        d = backbone.embed_dim
        grams[GRAM + "head"] = TensorSpec((d, d), dtype)
        if message.kind == "gram":
            return ReplySchema(grams, scalars={"num_samples": (int,)}, closed=True)
        if message.kind != "train":
            return None
        state = self.model.state_dict()
        names = factor_names(self.model, str(message.scalars["factor"])) + ["head.weight", "head.bias"]
        required = {k: TensorSpec.like(state[k]) for k in names}
        return ReplySchema({**required, **grams}, scalars={"num_samples": (int,), "loss": (int, float)}, closed=True)

    def state(self) -> Record:
        tensors = self.model.get_state()
        for t, task in enumerate(self.past):
            for f, group in task.items():
                tensors.update({f"{PAST}{t}/{f}/{k}": v for k, v in group.items()})
        tensors.update({f"{PAST}gram_sum/{k}": v for k, v in self.gram_sum.items()})
        return Record(tensors, {"lorm_task_started": self.task_started, "lorm_tasks_merged": len(self.past)})

    def load_state(self, state: Record) -> None:
        t = state.tensors
        self.model.set_state({k: v for k, v in t.items() if not k.startswith(PAST)})
        n = int(state.scalars.get("lorm_tasks_merged", 0))
        keys = [site_key(s) for s in self.adapter.sites]
        self.past = [{f: {k: t[f"{PAST}{i}/{f}/{k}"] for k in keys} for f in ("a", "b", "ag")} for i in range(n)]
        self.gram_sum = {k: t[f"{PAST}gram_sum/{k}"] for k in keys if f"{PAST}gram_sum/{k}" in t}
        self.task_started = int(state.scalars.get("lorm_task_started", -1))
        self._eval = None


register_method(
    "lorm",
    LoRMParams,
    LoRMServer,
    LoRMClient,
    build_model,
    "LoRA on every projection, one factor per round merged in closed form (RegMean), tasks merged by RegMean",
    "LoRM (Salami et al., ICLR 2025)",
    scenario_kinds=("class_incremental", "long_tailed"),
    signals=(prompt_mechanism,),
)
