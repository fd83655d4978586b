"""Class-wise prefix prompts with separate key and value tensors (FedMGP's fine-grained local prompts).

FedMGP (Yu et al., KDD'24, §4.2, Eq. 7–10): one prompt per class, P_l = {(k_l^c, P_l^c)}, each a prefix of length
L for the attention keys and a *separate* prefix of length L for the values (Eq. 9, MSA(h_Q, [P_K; h_K], [P_V;
h_V])) in each of `layers` (default 2–4, as the official code's `e_prompt_layer_idx`). During training the prompt
is chosen by the ground-truth class; at test time by cosine between a query and the keys (top-k, optional L2P
batch-wise voting), restricted to the allowed entries. Init U(−1, 1) for prompts and keys (official
`initializer = 'uniform'`). The pull constraint pulls the chosen keys towards the (detached) query:
mean over the batch of (1 − cos(q, k_s)).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import cosine, top_k_ids, uniform_


class ClassPrefixPool(nn.Module):
    """`num_classes` prefix prompts (separate K and V of length `length` per layer) with one key each."""

    CLASS_DIM: ClassVar[dict[str, int]] = {"keys": 0, "k_prompts": 1, "v_prompts": 1}  # the class axis of each

    def __init__(
        self, dim: int, num_classes: int, layers: tuple[int, ...] | list[int] = (2, 3, 4), length: int = 10
    ) -> None:
        super().__init__()
        self.layers = tuple(layers)
        self.keys = nn.Parameter(uniform_(torch.empty(num_classes, dim), -1, 1))
        self.k_prompts = nn.Parameter(uniform_(torch.empty(len(self.layers), num_classes, length, dim), -1, 1))
        self.v_prompts = nn.Parameter(uniform_(torch.empty(len(self.layers), num_classes, length, dim), -1, 1))

    def select(
        self, query: torch.Tensor, allowed: torch.Tensor | None = None, top_k: int = 1, batchwise: bool = False
    ) -> torch.Tensor:
        """(B, k) ids of the prompts whose keys are closest (cosine) to the query, among `allowed` (bool, (C,))."""
        sim = cosine(query.detach(), self.keys)
        if allowed is not None:
            sim = sim.masked_fill(~allowed.to(sim.device), float("-inf"))
            top_k = min(top_k, int(allowed.sum()))
        return top_k_ids(sim, top_k, batchwise)

    def pull_loss(self, query: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Mean over the batch and chosen keys of 1 − cos(q, k_id) (the query is detached)."""
        return (1 - cosine(query.detach(), self.keys).gather(1, ids)).mean()

    def forward(self, ids: torch.Tensor) -> PromptSpec:
        """Prefix spec for per-sample prompt ids (B, k): keys and values (B, k·L, d) in every layer."""
        k, v = self.k_prompts[:, ids], self.v_prompts[:, ids]  # (layers, B, k, L, d)
        return PromptSpec(
            prefix={layer: (k[i].flatten(1, 2), v[i].flatten(1, 2)) for i, layer in enumerate(self.layers)}
        )
