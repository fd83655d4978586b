"""`ClipTowers`: the interface every frozen vision–language backbone offers `ClipClassifier` (open_clip's
`FrozenCLIP`, the CPU-scale `MiniCLIP`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from promptfcl.backbones.precision import Precision


class ClipTowers(nn.Module):
    """What `ClipClassifier` needs of a frozen vision–language backbone (open_clip's `FrozenCLIP`, `MiniCLIP`).

    Shapes: `text_width` / `vision_width` (token widths, where text contexts and vision prompts live),
    `embed_dim` (the joint feature space), `text_layers` / `vision_layers`; `logit_scale` (a tensor); `device`.
    Text: `tokenize(texts)` → ids (N, L), `eot_index(ids)` → each sequence's end-token position,
    `token_embeddings(ids)`, `encode_text(embeds, ids, deep)`; image: `encode_image(x, prompts)`.
    Always in eval mode, nothing trainable, and a deep copy returns the same object (shared by every client)."""

    text_width: int
    vision_width: int
    embed_dim: int
    text_layers: int
    vision_layers: int
    logit_scale: torch.Tensor
    device: torch.device

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        raise NotImplementedError

    def eot_index(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode_text(
        self,
        embeds: torch.Tensor,
        tokens: torch.Tensor,
        deep: dict[int, tuple[int, torch.Tensor]] | None = None,
        normalize: bool = True,
    ) -> torch.Tensor:
        raise NotImplementedError

    def encode_image(
        self, x: torch.Tensor, prompts: dict[int, torch.Tensor] | None = None, normalize: bool = True
    ) -> torch.Tensor:
        raise NotImplementedError

    def configure(self, precision: Precision = "fp32", compile: bool = False) -> None:
        raise NotImplementedError

    def train(self, mode: bool = True) -> ClipTowers:  # the backbone never leaves eval mode
        return super().train(False)

    def __deepcopy__(self, memo: dict) -> ClipTowers:  # frozen and shared: a copied model keeps this one
        return self

    prompts_off: bool = False  # set inside `prompts_disabled()`

    @contextlib.contextmanager
    def prompts_disabled(self) -> Iterator[None]:
        """Inside it, a `ClipClassifier` predicts as zero-shot CLIP: its hand-crafted class texts and the prompt-free
        image features, none of its learned contexts, vision prompts or adapter (the validity gate's prompt-free
        pass: what the learned prompts add over zero-shot)."""
        before, self.prompts_off = self.prompts_off, True
        try:
            yield
        finally:
            self.prompts_off = before

    def enable_query_cache(self, on: bool = True) -> None:
        """CLIP methods use no query cache (API parity with `FrozenViT`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encode_image(x)
