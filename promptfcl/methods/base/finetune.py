"""Full fine-tuning of the ViT: the trainable network copy FedAvg-FT and CCVR's fine-tuned variant train.

Every weight of the backbone plus a linear head is trained locally. On a hybrid backbone (a frozen CNN stem as
patch embedding, `backbones.hybrid`) the stem stays frozen, in eval mode and cached, and is not part of the
trained or exchanged state: "full" fine-tuning trains everything after it (positions, class token, blocks, final
norm) — the stem is the asset's frozen ImageNet feature extractor, and training its BatchNorm on client batches
would break it. The whole network travels every round, so its bytes per round are the backbone's size.
"""


from __future__ import annotations

import copy
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from promptfcl.backbones.hybrid import has_stem
from promptfcl.backbones.precision import Precision, autocast
from promptfcl.backbones.vit import FrozenViT
from promptfcl.federation.protocol import MethodEnv
from promptfcl.methods.base.fedavg import FedAvgParams
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
    """A trainable copy of the backbone's ViT plus a linear head; `state_dict` is the whole network (a hybrid
    backbone's frozen CNN stem excepted: it stays in the shared frozen backbone, cached)."""

    def __init__(self, backbone: FrozenViT, num_logits: int, precision: Precision = "fp32") -> None:
        super().__init__()
        vit = backbone.vit
        object.__setattr__(self, "backbone", backbone)
        self.frozen_stem = has_stem(vit)
        if self.frozen_stem:  # copy everything but the stem
            stem, vit.patch_embed = vit.patch_embed, nn.Identity()
            try:
                self.vit = copy.deepcopy(vit)
            finally:
                vit.patch_embed = stem
        else:
            self.vit = copy.deepcopy(vit)
        self.vit.requires_grad_(True)
        self.head = nn.Linear(int(self.vit.embed_dim), num_logits)
        self.precision = precision  # engine.precision: the ViT runs under autocast, its weights stay float32

    def features(self, x: torch.Tensor) -> torch.Tensor:
        with autocast(x.device.type, self.precision):
            if not self.frozen_stem:
                return self.vit.forward_head(self.vit.forward_features(x), pre_logits=True).float()
            vit = self.vit
            h = vit.norm_pre(vit.patch_drop(vit._pos_embed(self.backbone.patch_tokens(x))))
            return vit.forward_head(vit.norm(vit.blocks(h)), pre_logits=True).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_finetuned_model(env: MethodEnv, p: FullFineTuneParams) -> FineTunedClassifier:
    """A trainable copy of the backbone (its frozen stem excepted) and a linear head."""
    return FineTunedClassifier(env.backbone, env.label_space.num_logits, env.backbone.precision)
