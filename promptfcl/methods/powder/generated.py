"""Powder's generated task prompt: one (client, task)'s own CODA-P block plus prompts generated from other tasks'.

Powder (Piao et al., ICML 2024; code piaohongming/Powder `src/models_Cprompt/vit_coda_p.py::CodaPrompt_2d_v2`)
gives every (client, task) g its own block of N CODA-P components P_g (prompts, keys K_g, attention vectors A_g per
prompted layer) and, through task-correlation weights W (rows summing to one), *generates* the prompts a task
uses from all trained tasks' blocks:

    G_i = Σ_j W[i, j] · P_j        (the same mix for P, K and A; j over the trained tasks)

Task g is served by the k generated blocks G_i of the k tasks i most correlated with g (top-k of W[g, ·]), their
k·N components concatenated and weighted by CODA-P's α = cos(q ⊙ A, K), the summed prompt divided by k
(the code's `p_all / topk_com`). While g trains, only its own block P_g learns: it enters every G_i with weight
W[i, g]; every other block is fixed (the code's `.detach()`).

This module holds exactly what one (client, task) needs: its own block (`own_*`, trainable) and, for each of the
k generated blocks, the fixed remainder R_i = Σ_{j≠g} W[i, j] · P_j (`rest_*`) and the coefficient c_i = W[i, g]
(`coef`), so G_i = c_i · P_g + R_i reproduces the code's forward term for term. `active` marks the blocks in use
(k may be smaller than the buffer when fewer tasks are trained). The server (`methods.powder`) fills these from
its pool of all task blocks; what travels down is this module's state, what travels up is `own_*` alone.
The evaluation-time "global" view of the code (`client_index == -1`: every trained task's G_i, prompts divided by
their number) is the same module with a zero own block and one active block per trained task.
"""

from __future__ import annotations

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.codap import attention_weights
from promptfcl.prompts.pools import require_query

PARTS = ("prompts", "keys", "attention")


class GeneratedTaskPrompt(nn.Module):
    """Own CODA-P block of one (client, task) + k generated blocks G_i = coef_i · own + rest_i."""

    needs_query = True

    def __init__(self, dim: int, layers: tuple[int, ...] | list[int], components: int, length: int, blocks: int):
        super().__init__()
        if length % 2:
            raise ValueError("Powder's prompt length must be even (half keys, half values)")
        if blocks < 1:
            raise ValueError("a generated task prompt needs at least one block")
        self.layers = tuple(layers)
        n = len(self.layers)
        self.own_prompts = nn.Parameter(torch.zeros(n, components, length, dim))
        self.own_keys = nn.Parameter(torch.zeros(n, components, dim))
        self.own_attention = nn.Parameter(torch.zeros(n, components, dim))
        self.register_buffer("rest_prompts", torch.zeros(blocks, n, components, length, dim))
        self.register_buffer("rest_keys", torch.zeros(blocks, n, components, dim))
        self.register_buffer("rest_attention", torch.zeros(blocks, n, components, dim))
        self.register_buffer("coef", torch.zeros(blocks))
        self.register_buffer("active", torch.zeros(blocks))
        self.aux_loss = torch.zeros(())

    def generated(self, part: str, layer_index: int) -> torch.Tensor:
        """The active generated blocks' rows of `part` in one layer, concatenated: (k·N, …)."""
        own = getattr(self, f"own_{part}")[layer_index]
        rest = getattr(self, f"rest_{part}")[:, layer_index]
        coef = self.coef.view(-1, *([1] * own.dim()))
        return (coef * own.unsqueeze(0) + rest)[self.active > 0].flatten(0, 1)

    def component_weights(self, query: torch.Tensor, layer_index: int = 0) -> torch.Tensor:
        """α (B, k·N) of the `layer_index`-th prompted layer over the generated components."""
        return attention_weights(query, self.generated("keys", layer_index), self.generated("attention", layer_index))

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        q = require_query(self, query)
        k = self.active.sum().clamp_min(1)
        out = {}
        for i, layer in enumerate(self.layers):
            alpha = self.component_weights(q, i)
            out[layer] = torch.einsum("bn,nld->bld", alpha, self.generated("prompts", i)) / k
        self.aux_loss = q.new_zeros(())
        return PromptSpec.split_half(out)

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state["aux_loss"] = self.aux_loss.detach()
        return state
