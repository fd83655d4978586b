"""`PromptSpec`: the one description of "what prompts go into this forward pass", shared by every method."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

TokenPosition = Literal["prepend", "append"]


@dataclass
class PromptSpec:
    """Per-sample prompts for one batch.

    - `prefix[layer] = (keys, values)`: tensors (B or 1, L, d) concatenated to the attention keys/values of that
      block (prefix tuning). Keys and values may have different lengths.
    - `tokens`: (B or 1, n, d) input prompt tokens inserted after the embedding: `prepend` puts them right after
      CLS (before the patches), `append` after the patches. `token_pos_embed` ((n, d) or (B, n, d)), if given, is
      added to them; otherwise they carry no positional embedding (L2P / C2Prompt convention).
    """

    prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tokens: torch.Tensor | None = None
    token_position: TokenPosition = "prepend"
    token_pos_embed: torch.Tensor | None = None

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
        return PromptSpec(prefix, pick(self.tokens), self.token_position, pick(self.token_pos_embed))  # type: ignore[arg-type]

    def is_empty(self) -> bool:
        return not self.prefix and self.tokens is None

    def merge(self, other: PromptSpec) -> PromptSpec:
        """Both specs at once: prefixes of a shared layer and tokens are concatenated (self first)."""
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
        return PromptSpec(prefix, src.tokens, src.token_position, src.token_pos_embed)
