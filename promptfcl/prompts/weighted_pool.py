"""HePCo's "decomposed prompting": a prompt pool weighted by raw cosine scores (Halbe et al., "HePCo: Data-Free
Heterogeneous Prompt Consolidation for Continual Federated Learning", §4.1 "Client Side: Decomposed Prompting";
`../shared/methods.md` §4.2, §4.9; official code `models/zoo_old.py::L2P`, `prompt_type='weighted_l2p'`,
`--prompt_param 100 20 1 -1`).

Per layer (default 0–4): M = 100 keys K ∈ R^{M×d} and prompts P ∈ R^{M×L×d} (L = 20), both initialised U(0, 1)
(CODA-P's `tensor_prompt` with ortho off). The layer's prompt for query q is
    p(x) = Σ_m cos(q(x), K_m) · P_m
with raw cosine weights — no softmax, no top-k, no attention vectors, negatives allowed, all M components always
active (the official `expand_and_freeze` is off). Its first L/2 tokens are the key prefix, the last L/2 the value
prefix. No auxiliary loss (HePCo's weighted variant sets μ = 0), no selection (`selected` stays None).

Official-code quirk, as a switch: the official prompt module detaches the normalised query, also when HePCo's
server evaluates the prompt output ρ(z) on generated latents, so the generator's prompt-MSE term gets no gradient
there. `detach_query=True` reproduces that; the default (False) lets gradients reach the query, as the paper's
objective intends. Client training is unaffected either way (the query has no gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import PromptPool, require_query, uniform_


class WeightedPool(PromptPool):
    """Per layer: prompt = Σ_m cos(q, K_m)·P_m over all M components (HePCo's decomposed prompt)."""

    def __init__(
        self,
        dim: int,
        layers: tuple[int, ...] | list[int] = (0, 1, 2, 3, 4),
        pool_size: int = 100,
        length: int = 20,
        detach_query: bool = False,
    ) -> None:
        super().__init__()
        if length % 2:
            raise ValueError("weighted-pool prompt length must be even (half keys, half values)")
        self.layers, self.detach_query = tuple(layers), detach_query
        self.keys = nn.Parameter(uniform_(torch.empty(len(self.layers), pool_size, dim), 0, 1))
        self.prompts = nn.Parameter(uniform_(torch.empty(len(self.layers), pool_size, length, dim), 0, 1))

    def layer_prompts(self, query: torch.Tensor) -> torch.Tensor:
        """(B, layers, L, d): Σ_m cos(q, K_m)·P_m for every prompted layer."""
        q = F.normalize(query.detach() if self.detach_query else query, dim=-1)
        w = torch.einsum("bd,lmd->blm", q, F.normalize(self.keys, dim=-1))
        return torch.einsum("blm,lmtd->bltd", w, self.prompts)

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        p = self.layer_prompts(require_query(self, query))
        self._no_aux(p)
        return PromptSpec.split_half({layer: p[:, i] for i, layer in enumerate(self.layers)})
