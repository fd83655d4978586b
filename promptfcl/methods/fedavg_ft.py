"""FedAvg-FT: full fine-tuning of the ViT with FedAvg, the lower bound of HePCo's Table 1.

Every weight of the backbone plus a linear head is trained locally (CE over the current task's logits) and
averaged (HePCo code: uniform mean of the whole state dict). Defaults from the HePCo paper's fine-tuning
baselines: Adam lr 5e-5, batch 64, 10 local epochs, CODA-P's per-epoch cosine schedule. The whole network
travels every round, so its bytes per round are the backbone's size.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from promptfcl.backbones.precision import Precision, autocast
from promptfcl.federation.protocol import MethodEnv
from promptfcl.methods.fedavg import FedAvgParams, FedAvgServer, SupervisedClient
from promptfcl.methods.registry import register_method
from promptfcl.model import ExchangedModel


class FullFineTuneParams(FedAvgParams):
    """Full fine-tuning defaults (HePCo's FedAvg-FT)."""

    lr: float = Field(5e-5, gt=0)
    local_epochs: int = Field(10, gt=0)
    batch_size: int = Field(64, gt=0)
    weighting: Literal["samples", "uniform"] = "uniform"
    lr_schedule: Literal["constant", "cosine", "coda_cosine"] = "coda_cosine"
    grad_clip: float | None = None


class FineTunedClassifier(ExchangedModel):
    """A trainable copy of the backbone's ViT plus a linear head; `state_dict` is the whole network."""

    def __init__(self, vit: nn.Module, num_logits: int, precision: Precision = "fp32") -> None:
        super().__init__()
        self.vit = copy.deepcopy(vit).requires_grad_(True)
        self.head = nn.Linear(int(self.vit.embed_dim), num_logits)
        self.precision = precision  # engine.precision: the ViT runs under autocast, its weights stay float32

    def features(self, x: torch.Tensor) -> torch.Tensor:
        with autocast(x.device.type, self.precision):
            return self.vit.forward_head(self.vit.forward_features(x), pre_logits=True).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_model(env: MethodEnv, p: FullFineTuneParams) -> FineTunedClassifier:
    return FineTunedClassifier(env.backbone.vit, env.label_space.num_logits, env.backbone.precision)


register_method(
    "fedavg_ft",
    FullFineTuneParams,
    FedAvgServer,
    SupervisedClient,
    build_model,
    "full fine-tuning of the ViT + head, FedAvg (lower bound)",
    "HePCo (TMLR 2024) baseline",
)
