"""Fed-CPrompt: Contrastive Prompt for Rehearsal-Free Federated Continual Learning (Bagwe, Yuan, Pan, Zhang;
FL-ICML 2023, arXiv 2307.04869; official code grbagwe/Fed-CPrompt, read at d8e9f38: `learners/prompt.py`,
`trainer_pacing_clients.py`, `experiments/asyncfed_CP_cifar100_niid.sh`, `configs/cifar100.yaml`).

Sources and tags. The paper's abstract ([P]): task-specific prompts learned communication-efficiently, with two
components — asynchronous prompt learning (clients receive tasks at different times) and a contrastive continual
loss C2L (heterogeneous data) — on a rehearsal-free CODA-P backbone. The equations are read from the official code
([C]) and two re-implementations: Powder's (piaohongming/Powder `src/prompt_hard.py`, prompt_flag `cprompt`) and
HePCo's (shaunak27/hepco-fed 9745b92 `learners/prompt.py`, `--loss_type triplet`, `../shared/methods.md` §4.8).
[I] marks our choices.

Model: CODA-P (`prompts.codap.CodaPool`; pool 100 components of length 8 in layers 0-4 split over the tasks,
α = cos(q ⊙ A, K), orthogonality weight 0 [C: `--prompt_param 100 8 0 0 0`]) + a linear head.

Asynchronous prompt learning [C `trainer_pacing_clients.py`]: a client trains the prompt block of *its own* current
task — the block of its position j in its own task sequence (its earlier blocks used, detached; later ones unused)
— whatever task the others are on; the server averages every tensor, weighted by samples [C
`federated_average`]. On the asynchronous scenario (Powder's benchmark) the position of the label-space task
g = j·K + k is j (`scenario.asynchronous`); on a synchronous scenario it is the run's task, so there Fed-CPrompt is
Fed-CODAP + C2L. Head rows of per-(client, task) slots come from the clients that own them (`owner_row_mean`,
as for every FedAvg method here). The evaluated model is the global one (blocks of every position reached so far).

C2L [C `TripletLoss`, `positive_loss`, `fedMoon 3`], added to the masked CE with weight `c2l_weight` (1 [C]):
anchor a = the client's current representation, positive p = the global model received this round, negative n =
the model of the client's previous task:
    L = max(0, Σ_batch (`positive_scale`·‖a − p‖² − `negative_scale`·‖a − n‖²) + `margin`)    (1e3, 1e1, 1 [C])
and, while the client is on its first task (no previous-task model), the positive term alone, Σ_batch 1e3·‖a − p‖².

What C2L does at the official strength (measured, `benchmarks/fedcprompt_c2l_weight.yaml`, the CPU evidence
study's asynchronous cell, seed 0): the positive term is a batch *sum* of 1e3 × squared distances against a CE that
is a batch *mean*, so it holds each client's prompted features within a small radius of the received model's
(`c2l_distance`, logged per round). CODA-P's init prompts barely move the features (1 − cos 0.0004 against the
prompt-free forward), and at weights 1 down to 1e-5 the prompts never leave their init (1 − cos 0.0004, 2 % of
predictions changed, the validity gate's prompt effect fails); they learn at 1e-7 (1 − cos 0.019, half the 0.035
without C2L), where the final-epoch features stay 0.84-1.67 from the received model's (norm 13.9; 5 seeds). The
weight stays the official 1 by default; the evidence cell sets `c2l_weight: 1e-7`.

Paper-vs-code and our switches (→ default):
- `c2l_on`: `features` (the prompted CLS before the head — the official code's `prelogits` and Powder's
  re-implementation) | `logits` (all logits — HePCo's re-implementation, where a first-task client uses the
  positive term alone too [I]) → features (the official code).
- Previous-task model: the official code snapshots the global model at the end of each task, shared by all clients
  (its tasks are synchronous apart from the pacing group). Here each client keeps in its own state the global
  model it received when it started its current task — the global model at the end of the stage before, for a
  client that just switched — so a client that keeps its task keeps its negative [I: the asynchronous reading,
  and no second model on the downlink].
- Local training [C `configs/cifar100.yaml`]: Adam lr 1e-4, 5 local epochs, batch 64, cosine over the epochs
  (CODA-P's per-epoch cosine here [I]), sample-weighted FedAvg.
- Not implemented: the code's MOON-style alternatives (`fedMoon` 1, 2), FedProx (`muProx`) and its early stopping on
  a validation split; the pacing trainer's half-round task switch (the asynchronous scenario's stage schedule
  decides who is on which task).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from promptfcl.evaluation.validity import prompt_mechanism
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import ClientContext, MethodEnv, RoundInfo
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import FedAvgServer, SupervisedClient
from promptfcl.methods.base.prompt_models import CodaParams, build_codap
from promptfcl.methods.fedcprompt.signals import c2l_on
from promptfcl.model import PromptedClassifier
from promptfcl.scenario.label_space import masked_logits
from promptfcl.training.local import LossFn

PREV = "fcp_prev/"  # the previous-task model in the client's state
# logged per round (client means): the C2L term; in the final local epoch, the mean distance between the client's
# representation and the received model's on the same images, and the representation's norm
DIAGNOSTICS = ("c2l_loss", "c2l_distance", "c2l_anchor_norm")


class FedCPromptParams(CodaParams):
    """Fed-CPrompt's CODA-P pool, local training and C2L (official code's values)."""

    weighting: Literal["samples", "uniform"] = "samples"
    lr: float = Field(1e-4, gt=0)
    local_epochs: int = Field(5, gt=0)
    c2l_weight: float = Field(1.0, ge=0, description="weight of the contrastive continual loss (0: Fed-CODAP)")
    c2l_on: Literal["features", "logits"] = Field(
        "features", description="features: prompted CLS (official code, Powder) | logits: all logits (HePCo)"
    )
    positive_scale: float = Field(1e3, gt=0)
    negative_scale: float = Field(1e1, ge=0)
    margin: float = Field(1.0, ge=0)


def sequence_position(env: MethodEnv, stage: int, client: int) -> int:
    """The position in its own task sequence of the task `client` trains in `stage` (g = j·K + k)."""
    if env.schedule is None:
        return stage
    return env.label_task(stage, client) // len(env.schedule[stage])


def contrastive_continual_loss(
    anchor: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor | None, p: FedCPromptParams
) -> torch.Tensor:
    """C2L: a triplet on squared distances summed over the batch (positive term alone without a negative)."""
    pos = p.positive_scale * (anchor - positive).pow(2).sum(1)
    if negative is None:
        return pos.sum()
    neg = p.negative_scale * (anchor - negative).pow(2).sum(1)
    return F.relu((pos - neg).sum() + p.margin)


class FedCPromptClient(SupervisedClient):
    """Trains its own task's CODA-P block with masked CE + C2L against the received and the previous-task model."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._positive: nn.Module | None = None  # working copies, reloaded for every message
        self._negative: nn.Module | None = None
        self._terms: list[tuple[float, float]] = []  # per-step (CE, C2L) of the message being handled
        self._reach: list[tuple[float, float]] = []  # per-step mean ‖a − p‖ and ‖a‖ (how far C2L lets a move)

    def pool_task(self, ctx: ClientContext) -> int:
        return sequence_position(self.env, ctx.stage, ctx.client_id)

    def loaded(self, slot: str, state: dict[str, torch.Tensor], task: int) -> nn.Module:
        model = getattr(self, slot) or self.new_model()
        setattr(self, slot, model)
        model.set_state(state)
        model.prompt.set_task(task)
        return model.eval()

    def loss_fn(self, message: Message, ctx: ClientContext) -> LossFn:
        p, task = self.params, self.pool_task(ctx)
        received = {k: message.tensors[k] for k in self.model.state_dict()}
        st = ctx.state.scalars
        if st.get("fcp_label_task") != ctx.label_task:  # a new task: what it receives now is its previous task's model
            if st.get("fcp_label_task") is not None:
                ctx.state.tensors.update({PREV + k: v.clone() for k, v in received.items()})
                st["fcp_prev_position"] = st["fcp_position"]
            st.update(fcp_label_task=ctx.label_task, fcp_position=task)
        prev = {k[len(PREV) :]: v for k, v in ctx.state.tensors.items() if k.startswith(PREV)}
        positive = self.loaded("_positive", received, task) if p.c2l_weight > 0 else None
        negative = None
        if p.c2l_weight > 0 and prev:  # the previous-task model serves its own task's position
            negative = self.loaded("_negative", prev, int(st["fcp_prev_position"]))

        def represent(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            feats = model.features(x)
            return feats, model.head(feats)

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            feats, logits = represent(model, x)
            ce = F.cross_entropy(masked_logits(logits, mask), y)
            c2l = logits.new_zeros(())
            if positive is not None:
                pick = 0 if p.c2l_on == "features" else 1
                with torch.no_grad():
                    pos = represent(positive, x)[pick]
                    neg = represent(negative, x)[pick] if negative is not None else None
                anchor = (feats, logits)[pick]
                c2l = p.c2l_weight * contrastive_continual_loss(anchor, pos, neg, p)
                a = anchor.detach()
                self._reach.append((float((a - pos).norm(dim=1).mean()), float(a.norm(dim=1).mean())))
            self._terms.append((float(ce.detach()), float(c2l.detach())))
            return ce + model.prompt.aux_loss + c2l

        return loss

    def train(self, model: nn.Module, ctx: ClientContext, message: Message) -> dict[str, float]:
        """Local training; `last_loss` is the final epoch's CE (the validity gate's learning signal, compared with
        the label-prior loss), `c2l_loss` the mean C2L term, `loss` the mean of the whole objective."""
        self._terms, self._reach = [], []
        stats = super().train(model, ctx, message)
        steps = math.ceil(len(ctx.train_data) / self.params.batch_size)
        if self._terms:
            last = self._terms[-steps:]
            stats["last_loss"] = sum(ce for ce, _ in last) / len(last)
            stats["c2l_loss"] = sum(c for _, c in self._terms) / len(self._terms)
        if self._reach:  # the final epoch: how far from the received model's representation C2L let the client go
            last = self._reach[-steps:]
            stats["c2l_distance"] = sum(d for d, _ in last) / len(last)
            stats["c2l_anchor_norm"] = sum(n for _, n in last) / len(last)
        return stats

    def reply(self, model: nn.Module, ctx: ClientContext, stats: dict[str, float]) -> Message:
        reply = super().reply(model, ctx, stats)
        for key in DIAGNOSTICS:
            if key in stats:
                reply.scalars[key] = float(stats[key])
        return reply


class FedCPromptServer(FedAvgServer):
    """FedAvg of every tensor (head rows from their owners); logs the round's mean C2L term and reach."""

    def after_aggregate(self, replies: dict[int, Message], info: RoundInfo) -> dict[str, float]:
        out = {}
        for key in DIAGNOSTICS:
            values = [float(r.scalars[key]) for r in replies.values() if key in r.scalars]
            if values:
                out[key] = sum(values) / len(values)
        return out


def build_model(env: MethodEnv, p: FedCPromptParams) -> PromptedClassifier:
    return build_codap(env, p)


register_method(
    "fedcprompt",
    FedCPromptParams,
    FedCPromptServer,
    FedCPromptClient,
    build_model,
    "CODA-P; each client trains its own task's block (asynchronous prompt learning) with the contrastive continual "
    "loss (triplet: received vs previous-task model), FedAvg",
    "Fed-CPrompt (FL-ICML 2023)",
    signals=(c2l_on, prompt_mechanism),
)
