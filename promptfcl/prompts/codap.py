"""CODA-Prompt's attention-weighted prompt components (Smith et al., "CODA-Prompt: COntinual Decomposed
Attention-based Prompting for Rehearsal-Free Continual Learning", CVPR 2023, §4.1 Eq. 3–5 prompt formation,
§4.2 expansion and orthogonality, Eq. 6–7 objective; official code `models/zoo.py::CodaPrompt`).

Per layer (default 0–4): N components P ∈ R^{N×L×d} (N = 100, L = 8), keys K ∈ R^{N×d} and attention vectors
A ∈ R^{N×d}; the pool is split evenly over `num_tasks`, task t owning components [t·N/T, (t+1)·N/T). For query q
    α_m = cos(q ⊙ A_m, K_m)            (no softmax, no top-k)
and the layer's prompt is Σ_m α_m P_m over the components of tasks ≤ t, split half key / half value prefix. While
training task t, earlier tasks' components, keys and attention vectors are used but detached (official
`torch.cat((K[:s].detach().clone(), K[s:f]))`); later tasks' components are excluded. Every layer has its own P, K
and A and uses the same query. `set_task(t)` draws, exactly once per task, the new block of P (flattened to
(n, L·d)), K and A by Gram–Schmidt orthogonal to all earlier blocks (the official code's per-task re-init);
the `initialized_tasks` buffer travels with the state dict, so reloading a state never redraws a block.
`aux_loss` is the orthogonality regulariser μ · Σ_layers [o(K) + o(A) + o(P)] over the active (earlier ones
detached) components, o(X) = mean((XXᵀ − I)²) as in the official `ortho_penalty`, μ = `ortho_mu` (default 0,
the official setting since the Gram–Schmidt re-init).

Deviations: the regulariser is a mean over matrix entries (official code), not the squared Frobenius norm of the
paper's Eq. 6 (a factor n²); Gram–Schmidt is exact (see `pools.py`). Blocks of tasks not yet started are zeros
(the official code leaves them at their U(0, 1) init); they never take part before being drawn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import PromptPool, gram_schmidt_, require_query


def attention_weights(query: torch.Tensor, keys: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """CODA-P's component weights α (B, n) = cos(q ⊙ A_m, K_m) of queries (B, d) for components with keys and
    attention vectors (n, d) — Eq. 4 of the paper, shared by every pool built from CODA-P components."""
    aq = F.normalize(query.unsqueeze(1) * attention.unsqueeze(0), dim=-1)  # (B, n, d)
    return torch.einsum("bnd,nd->bn", aq, F.normalize(keys, dim=-1))


def ortho_penalty(t: torch.Tensor) -> torch.Tensor:
    """mean((XXᵀ − I)²) of the rows of `t` flattened (CODA-P's `ortho_penalty`)."""
    x = t.flatten(1)
    return (x @ x.T - torch.eye(len(x), dtype=x.dtype, device=x.device)).pow(2).mean()


class CodaPool(PromptPool):
    """CODA-P components with keys and attention vectors, grown per task by masking a fixed-size pool."""

    def __init__(
        self,
        dim: int,
        num_tasks: int,
        layers: tuple[int, ...] | list[int] = (0, 1, 2, 3, 4),
        pool_size: int = 100,
        length: int = 8,
        ortho_mu: float = 0.0,
    ) -> None:
        super().__init__()
        if length % 2:
            raise ValueError("CODA-P prompt length must be even (half keys, half values)")
        if num_tasks <= 0 or pool_size % num_tasks:
            raise ValueError(f"CODA-P pool size {pool_size} must split evenly over {num_tasks} tasks")
        self.layers, self.num_tasks, self.ortho_mu = tuple(layers), num_tasks, ortho_mu
        self.per_task = pool_size // num_tasks
        n = len(self.layers)
        self.prompts = nn.Parameter(torch.zeros(n, pool_size, length, dim))
        self.keys = nn.Parameter(torch.zeros(n, pool_size, dim))
        self.attention = nn.Parameter(torch.zeros(n, pool_size, dim))
        self.register_buffer("initialized_tasks", torch.zeros((), dtype=torch.long))  # blocks drawn so far
        self.set_task(0)

    def set_task(self, task: int) -> None:
        if task >= self.num_tasks:
            raise ValueError(f"task {task} is beyond the {self.num_tasks} tasks this CODA-P pool was split over")
        super().set_task(task)
        with torch.no_grad():
            while int(self.initialized_tasks) <= task:  # once per block, never again (also after a reload)
                b = int(self.initialized_tasks)
                s, f = b * self.per_task, (b + 1) * self.per_task
                for i in range(len(self.layers)):
                    for t in (self.prompts, self.keys, self.attention):
                        gram_schmidt_(t[i], s, f)
                self.initialized_tasks += 1

    def _active(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of tasks ≤ t; while training, those of earlier tasks detached."""
        s, f = self.task * self.per_task, (self.task + 1) * self.per_task
        if self.training:
            return torch.cat([t[:s].detach(), t[s:f]])
        return t[:f]

    def component_weights(self, query: torch.Tensor, layer_index: int = 0) -> torch.Tensor:
        """α (B, active components) of the `layer_index`-th prompted layer: cos(q ⊙ A_m, K_m)."""
        return attention_weights(query, self._active(self.keys[layer_index]), self._active(self.attention[layer_index]))

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        q = require_query(self, query)
        out, aux = {}, q.new_zeros(())
        for i, layer in enumerate(self.layers):
            out[layer] = torch.einsum("bn,nld->bld", self.component_weights(q, i), self._active(self.prompts[i]))
            if self.training and self.ortho_mu > 0:
                aux = aux + sum(ortho_penalty(self._active(t[i])) for t in (self.keys, self.attention, self.prompts))
        self.aux_loss = self.ortho_mu * aux
        return PromptSpec.split_half(out)
