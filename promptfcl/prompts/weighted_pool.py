"""HePCo's decomposed prompt: a weighted pool with raw-cosine weights (HePCo §4.1; `../shared/methods.md` §4.2).

Per layer (0–4 by default): M = 100 keys K ∈ R^{M×d} and prompts P ∈ R^{M×L×d} (L = 20), initialised U(0, 1)
(CODA-P's `tensor_prompt` with ortho off, as HePCo's code calls it). The layer's prompt for query q is
Σ_m cos(q, K_m)·P_m — raw cosine weights: no softmax, no top-k, no attention vectors, negatives allowed — and its
first L/2 tokens are the key prefix, the last L/2 the value prefix. No key-matching loss (HePCo's weighted
variant sets μ = 0).
"""

from __future__ import annotations

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import PromptPool, cosine, uniform_


class WeightedPool(PromptPool):
    """Per layer: prompt = Σ_m cos(q, K_m)·P_m over all M components (HePCo)."""

    def __init__(
        self, dim: int, layers: tuple[int, ...] | list[int] = (0, 1, 2, 3, 4), pool_size: int = 100, length: int = 20
    ) -> None:
        super().__init__()
        if length % 2:
            raise ValueError("weighted-pool prompt length must be even (half keys, half values)")
        self.layers = tuple(layers)
        self.keys = nn.Parameter(uniform_(torch.empty(len(self.layers), pool_size, dim), 0, 1))
        self.prompts = nn.Parameter(uniform_(torch.empty(len(self.layers), pool_size, length, dim), 0, 1))

    def layer_prompts(self, query: torch.Tensor) -> torch.Tensor:
        """(B, layers, L, d): Σ_m cos(q, K_m)·P_m for every layer."""
        w = torch.stack([cosine(query, k) for k in self.keys], dim=1)  # (B, layers, M)
        return torch.einsum("blm,lmtd->bltd", w, self.prompts)

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        if query is None:
            raise ValueError("WeightedPool needs the query q(x)")
        p = self.layer_prompts(query)
        return PromptSpec.split_half({layer: p[:, i] for i, layer in enumerate(self.layers)})
