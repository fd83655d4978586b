"""`PromptSpec`: the one description of "what prompts go into this forward pass", shared by every method."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

TokenPosition = Literal["prepend", "append"]
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")  # timm Block: attn.qkv, attn.proj, mlp.fc1, mlp.fc2


class LoRADelta(NamedTuple):
    """A weight delta ΔW = scale · B·A on one linear projection (W: (out, in)), applied beside the frozen W.

    `a` (r, in) and `b` (out, r) are the low-rank factors; with `a=None`, `b` is the dense delta (out, in) itself
    (a closed-form merge that is not low rank). The projection computes W·x + bias + scale·B·(A·x).
    """

    a: torch.Tensor | None
    b: torch.Tensor
    scale: float = 1.0

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """scale · x·(B·A)ᵀ without forming B·A (x: (..., in) → (..., out))."""
        h = x if self.a is None else F.linear(x, self.a.to(x.dtype))
        y = F.linear(h, self.b.to(x.dtype))
        return y if self.scale == 1.0 else y * self.scale

    def dense(self) -> torch.Tensor:
        """ΔW as an (out, in) matrix (what merging into the frozen weight adds)."""
        w = self.b if self.a is None else self.b @ self.a
        return w * self.scale

    def plus(self, other: LoRADelta) -> LoRADelta:
        """ΔW₁ + ΔW₂: two low-rank deltas stack their ranks (B = [s₁B₁ s₂B₂], A = [A₁; A₂]); else dense."""
        if self.a is not None and other.a is not None:
            a = torch.cat([self.a, other.a], dim=0)
            return LoRADelta(a, torch.cat([self.b * self.scale, other.b * other.scale], dim=1))
        return LoRADelta(None, self.dense() + other.dense())


@dataclass
class PromptSpec:
    """Per-sample prompts for one batch.

    - `prefix[layer] = (keys, values)`: tensors (B or 1, L, d) concatenated to the attention keys/values of that
      block (prefix tuning). Keys and values may have different lengths.
    - `tokens`: (B or 1, n, d) input prompt tokens inserted after the embedding: `prepend` puts them right after
      CLS (before the patches), `append` after the patches. `token_pos_embed` ((n, d) or (B, n, d)), if given, is
      added to them; otherwise they carry no positional embedding (L2P / C2Prompt convention).
    - `lora[layer][target] = LoRADelta(A, B, scale)`: low-rank weight deltas on that block's projections, targets
      `qkv`, `proj` (attention), `fc1`, `fc2` (MLP); shared by the batch. Applied in the same forward as the
      prompts; a block with neither prompts nor deltas runs timm's own module.
    """

    prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tokens: torch.Tensor | None = None
    token_position: TokenPosition = "prepend"
    token_pos_embed: torch.Tensor | None = None
    lora: dict[int, dict[str, LoRADelta]] = field(default_factory=dict)

    @staticmethod
    def split_half(prompts: dict[int, torch.Tensor]) -> PromptSpec:
        """Prefix from length-L prompts: first L/2 tokens are keys, last L/2 values (HGP, HePCo, CODA-P)."""
        prefix = {}
        for layer, p in prompts.items():
            if p.shape[-2] % 2:
                raise ValueError(f"split-half prefix needs an even length, got {p.shape[-2]} in layer {layer}")
            half = p.shape[-2] // 2
            prefix[layer] = (p[..., :half, :], p[..., half:, :])
        return PromptSpec(prefix=prefix)

    def select(self, rows: torch.Tensor, batch_size: int) -> PromptSpec:
        """The spec of a sub-batch: per-sample tensors (leading dim `batch_size`) indexed by `rows`; shared
        (leading dim 1) tensors kept as they are."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[rows] if t is not None and t.shape[0] == batch_size and t.dim() == 3 else t

        prefix = {layer: (pick(k), pick(v)) for layer, (k, v) in self.prefix.items()}
        return PromptSpec(
            prefix,  # type: ignore[arg-type]
            pick(self.tokens),
            self.token_position,
            pick(self.token_pos_embed),
            self.lora,
        )

    def is_empty(self) -> bool:
        return not self.prefix and self.tokens is None and not any(self.lora.values())

    def merge(self, other: PromptSpec) -> PromptSpec:
        """Both specs at once: prefixes of a shared layer are concatenated (self first), deltas on the same
        projection are added (`LoRADelta.plus`), input tokens may come from one spec only."""
        prefix = dict(self.prefix)
        for layer, (k, v) in other.prefix.items():
            if layer in prefix:
                k0, v0 = prefix[layer]
                b = max(k0.shape[0], k.shape[0])
                k = torch.cat([k0.expand(b, -1, -1), k.expand(b, -1, -1)], dim=1)
                v = torch.cat([v0.expand(b, -1, -1), v.expand(b, -1, -1)], dim=1)
            prefix[layer] = (k, v)
        if self.tokens is not None and other.tokens is not None:
            raise ValueError("merging two specs that both carry input tokens is ambiguous")
        src = self if self.tokens is not None else other
        lora = {layer: dict(deltas) for layer, deltas in self.lora.items()}
        for layer, deltas in other.lora.items():
            mine = lora.setdefault(layer, {})
            for target, d in deltas.items():
                mine[target] = mine[target].plus(d) if target in mine else d
        return PromptSpec(prefix, src.tokens, src.token_position, src.token_pos_embed, lora)
