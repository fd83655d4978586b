"""`PromptedClassifier`: frozen shared backbone + optional prompt module + linear head."""

from __future__ import annotations

import torch
from torch import nn

from promptfcl.backbones.vit import FrozenViT


class ExchangedModel(nn.Module):
    """A model whose `state_dict` is exactly what travels between server and clients."""

    def get_state(self) -> dict[str, torch.Tensor]:
        """Detached copies of every trainable tensor (what a message carries)."""
        return {k: v.detach().clone() for k, v in self.state_dict().items()}

    def set_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(tensors, strict=True)


class PromptedClassifier(ExchangedModel):
    """The trainable part of a prompt method around a frozen backbone.

    The backbone is held by reference and is *not* a submodule, so `parameters()` / `state_dict()` contain only
    the prompt and the head — exactly what clients train and exchange — and many models share one backbone.
    """

    def __init__(self, backbone: FrozenViT, num_logits: int, prompt: nn.Module | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "backbone", backbone)
        self.prompt = prompt
        self.head = nn.Linear(backbone.embed_dim, num_logits)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        spec = None
        if self.prompt is not None:
            query = self.backbone.query(x) if getattr(self.prompt, "needs_query", False) else None
            spec = self.prompt(x.shape[0], query)
        return self.backbone(x, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))
