"""CODA-Prompt's attention-weighted component pool (Smith et al., CVPR 2023, §4, Eq. 3–6).

Per layer (0–4): N components P ∈ R^{N×L×d} (default N = 100, L = 8), keys K ∈ R^{N×d} and attention vectors
A ∈ R^{N×d}; the pool is split evenly over the tasks, task t owning components [t·N/T, (t+1)·N/T). For query q,
α_m = cos(q ⊙ A_m, K_m) (no softmax, no top-k) and the layer's prompt is Σ_m α_m P_m over the components of
tasks ≤ t, split half key / half value prefix. While training task t, earlier tasks' components, keys and
attention vectors are used but detached (CODA-P code: `torch.cat((K[:s].detach().clone(), K[s:f]))`). When a
task starts (`start_task`, on the server), its block of P, K and A is re-drawn by Gram–Schmidt orthogonal to
the earlier blocks (flattened per component). `aux_loss` is CODA-P's orthogonality regulariser
μ·Σ(‖KKᵀ−I‖² + ‖AAᵀ−I‖² + ‖PPᵀ−I‖²) over the active block, μ = `ortho_mu` (CODA-P default 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import PromptPool, gram_schmidt_


class CodaPool(PromptPool):
    """CODA-P components with keys and attention vectors, grown per task by masking."""

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
        if pool_size % num_tasks:
            raise ValueError(f"CODA-P pool size {pool_size} must split evenly over {num_tasks} tasks")
        self.layers, self.num_tasks, self.ortho_mu = tuple(layers), num_tasks, ortho_mu
        self.per_task = pool_size // num_tasks
        n = len(self.layers)
        self.prompts = nn.Parameter(torch.zeros(n, pool_size, length, dim))
        self.keys = nn.Parameter(torch.zeros(n, pool_size, dim))
        self.attention = nn.Parameter(torch.zeros(n, pool_size, dim))
        self.register_buffer("initialized_tasks", torch.zeros((), dtype=torch.long))  # blocks drawn so far
        self.start_task(0)

    def start_task(self, task: int) -> None:
        super().start_task(task)
        while int(self.initialized_tasks) <= task:  # once per block, never again (also after a reload)
            b = int(self.initialized_tasks)
            s, f = b * self.per_task, (b + 1) * self.per_task
            for i in range(len(self.layers)):
                for t in (self.prompts[i], self.keys[i], self.attention[i]):
                    gram_schmidt_(t.data, s, f)
            self.initialized_tasks += 1

    def _active(self, t: torch.Tensor) -> torch.Tensor:
        s, f = self.task * self.per_task, (self.task + 1) * self.per_task
        if self.training:
            return torch.cat([t[:s].detach(), t[s:f]])
        return t[:f]

    def component_weights(self, query: torch.Tensor, layer_index: int = 0) -> torch.Tensor:
        """α (B, active components) of one layer: cos(q ⊙ A_m, K_m)."""
        k, a = self._active(self.keys[layer_index]), self._active(self.attention[layer_index])
        return (F.normalize(query.unsqueeze(1) * a.unsqueeze(0), dim=-1) * F.normalize(k, dim=-1)).sum(-1)

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        if query is None:
            raise ValueError("CodaPool needs the query q(x)")
        out, aux = {}, torch.zeros((), device=query.device)
        for i, layer in enumerate(self.layers):
            alpha = self.component_weights(query, i)
            out[layer] = torch.einsum("bm,mld->bld", alpha, self._active(self.prompts[i]))
            if self.training and self.ortho_mu > 0:
                f = (self.task + 1) * self.per_task
                for t in (self.keys[i], self.attention[i], self.prompts[i]):
                    block = t[:f].flatten(1)
                    aux = aux + (block @ block.T - torch.eye(f, device=block.device)).pow(2).mean()
        self.aux_loss = self.ortho_mu * aux
        return PromptSpec.split_half(out)
