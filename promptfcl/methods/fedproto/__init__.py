"""FedProto: Federated Prototype Learning (Tan et al., AAAI 2022), for FCIL on a frozen prompted ViT.

Paper §4 (Algorithm 1): clients upload per-class prototypes C_i^(j) = mean feature of class j on client i
(Eq. 5); the server averages them per class weighted by sample counts, C̄^(j) = Σ_i |D_{i,j}|/N_j · C_i^(j)
(Eq. 6), and sends them back; local training minimises CE + λ·‖f(x) − C̄^(y)‖² (Eq. 7–8, MSE over the feature,
λ = 1); inference assigns the class of the nearest global prototype (§4.3, "the prediction is the label of the
closest global prototype").

Adaptation to class-incremental FL (as HGP's baseline, fed-mammoth `_models/fedproto.py`): the prompt and head
are also FedAvg'd so there is one global model to evaluate — the paper's clients have private heterogeneous
models and share only prototypes, which leaves no global model for task-agnostic evaluation (deviation).
Prototypes of a task are frozen at its last round and kept for every seen class (prototype inference needs
them); the regulariser uses the current task's global prototypes, available from the task's second round.
So with one round per task the regulariser never fires — the same in fed-mammoth (`begin_task` empties the
task's global prototypes; a client only holds current-task classes, so earlier tasks' prototypes would match
none of its samples) and in the paper's Algorithm 1, whose first round has no global prototypes yet. Such a run
is FedAvg-Prompt training plus nearest-prototype inference. The round metric `proto_reg_classes` is the number
of current-task prototypes the clients received (0: the regulariser was off that round).

Choices (switch → default):
- `inference`: "prototype" (paper) | "head" (fed-mammoth) → paper.
- `proto_lambda`: 1.0 (paper) | 0.1 (fed-mammoth) → paper.
- `proto_reg`: "sample" (paper: every feature to its class prototype) | "class_mean" (fed-mammoth: each
  class's batch mean to its prototype) → paper.
Extension, off by default: `privacy` releases the prototypes through the Gaussian mechanism (`statistics.privacy`).
Prompt and optimiser as `fedavg_prompt` (prefix length 20 in layers 0–4, Adam lr 3e-3, batch 16, 5 epochs).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from promptfcl.evaluation.validity import prompt_mechanism, switch_on
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, RoundInfo
from promptfcl.federation.validation import TensorSpec
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import FedAvgServer, SupervisedClient
from promptfcl.methods.base.prompt_models import FedAvgPromptParams, build_prefix_model
from promptfcl.scenario.label_space import masked_logits
from promptfcl.statistics import class_statistics, pooled, uploaded_statistics
from promptfcl.statistics.class_stats import extract_features, statistics_schema
from promptfcl.statistics.privacy import PrivacyParams, noise_generator, private_class_statistics
from promptfcl.training.local import LossFn, LossTerms


class FedProtoParams(FedAvgPromptParams):
    """FedProto defaults (paper) on top of the prefix-prompt model."""

    proto_lambda: float = Field(1.0, ge=0, description="weight of the prototype regulariser")
    proto_reg: Literal["sample", "class_mean"] = "sample"
    inference: Literal["prototype", "head"] = "prototype"
    privacy: PrivacyParams = Field(default_factory=PrivacyParams, description="Gaussian noise on uploaded prototypes")


class PrototypeClassifier(nn.Module):
    """Scores classes by −‖f(x) − C̄_c‖² to the global prototypes; classes without one score −∞."""

    def __init__(self, model: nn.Module, protos: torch.Tensor, known: torch.Tensor) -> None:
        super().__init__()
        self.model, self.protos, self.known = model, protos, known

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.model.features(x)
        d = torch.cdist(f, self.protos.to(f.device)).pow(2)
        return (-d).masked_fill(~self.known.to(f.device), float("-inf"))


class FedProtoClient(SupervisedClient):
    """CE + λ·MSE to the server's prototypes; uploads class prototypes with counts."""

    def loss_fn(self, message: Message, ctx: ClientContext) -> LossFn:
        p = self.params
        if "protos/classes" not in message.tensors or p.proto_lambda == 0:
            return super().loss_fn(message, ctx)
        table = torch.zeros(self.env.label_space.num_logits, self.env.backbone.embed_dim, device=ctx.device)
        known = torch.zeros(self.env.label_space.num_logits, dtype=torch.bool, device=ctx.device)
        table[message.tensors["protos/classes"]] = message.tensors["protos/means"].to(ctx.device)
        known[message.tensors["protos/classes"]] = True

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> LossTerms:
            f = model.features(x)
            ce = F.cross_entropy(masked_logits(model.head(f), mask), y)
            has = known[y]
            if not has.any():
                return LossTerms(ce, ce)
            f, y = f[has], y[has]
            if p.proto_reg == "class_mean":
                classes, inv = torch.unique(y, return_inverse=True)
                means = torch.zeros(len(classes), f.shape[1], device=f.device).index_add_(0, inv, f)
                means = means / torch.bincount(inv).unsqueeze(1)
                return LossTerms(ce + p.proto_lambda * F.mse_loss(means, table[classes]), ce)
            return LossTerms(ce + p.proto_lambda * F.mse_loss(f, table[y]), ce)

        return loss

    def reply(self, model: nn.Module, ctx: ClientContext, stats: dict[str, float]) -> Message:
        msg = super().reply(model, ctx, stats)
        if len(ctx.train_data):
            p = self.params.privacy
            if p.enabled:  # (ε, δ)-DP prototypes of every class of the task (statistics.privacy)
                feats, ys = extract_features(model.features, ctx.train_data, self.env.eval_transform, ctx.device)
                classes = self.env.label_space.tasks[ctx.stage].logits
                st = private_class_statistics(feats, ys, classes, "none", 1, p, noise_generator(p, ctx.seed))
            else:
                st = class_statistics(model.features, ctx.train_data, self.env.eval_transform, ctx.device, "none", 1)
            msg.tensors.update(st.to_tensors())
        return msg


class FedProtoServer(FedAvgServer):
    """FedAvg of prompt + head, count-weighted prototype averaging, prototype (or head) inference."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        n, d = self.env.label_space.num_logits, self.env.backbone.embed_dim
        self.protos = torch.zeros(n, d)
        self.known = torch.zeros(n, dtype=torch.bool)
        self.sent_protos = 0  # current-task prototypes in this round's downlink

    def reply_groups(self) -> list[dict[str, TensorSpec]]:
        return [statistics_schema(self.env.label_space.num_logits, self.env.backbone.embed_dim, "none")]

    def downlink(self, info: RoundInfo) -> Message:
        current = torch.tensor(self.env.label_space.tasks[info.stage].logits)
        current = current[self.known[current]]  # the current task's prototypes, once they exist
        self.sent_protos = len(current)
        return Message(
            {**self.model.get_state(), "protos/classes": current, "protos/means": self.protos[current]}, kind="train"
        )

    def after_aggregate(self, replies: dict[int, Message], info: RoundInfo) -> dict[str, float]:
        stats = uploaded_statistics(replies)
        if stats:
            g = pooled(stats)
            self.protos[g.classes] = g.means
            self.known[g.classes] = True
        return {"proto_reg_classes": float(self.sent_protos if self.params.proto_lambda > 0 else 0)}

    def global_model(self) -> nn.Module:
        if self.params.inference == "head":
            return self.model
        return PrototypeClassifier(self.model, self.protos, self.known)

    def state(self) -> Record:
        return Record({**self.model.get_state(), "protos/means": self.protos, "protos/known": self.known})

    def load_state(self, state: Record) -> None:
        t = dict(state.tensors)
        self.protos, self.known = t.pop("protos/means"), t.pop("protos/known").bool()
        self.model.set_state(t)


prototypes_on = switch_on("prototypes_on", "proto_lambda", "the prototype regulariser")


register_method(
    "fedproto",
    FedProtoParams,
    FedProtoServer,
    FedProtoClient,
    build_prefix_model,
    "FedAvg'd prefix prompt + head with prototype regularisation and nearest-prototype inference",
    "FedProto (Tan et al., AAAI 2022)",
    signals=(prototypes_on, prompt_mechanism),
)
