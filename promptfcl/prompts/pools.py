"""Shared machinery of query-conditioned prompt pools (L2P, DualPrompt, CODA-P, HePCo's weighted pool).

A pool is a prompt module with `needs_query = True`: `forward(batch_size, q)` turns the unprompted query q(x)
into a `PromptSpec`. Every learnable tensor is allocated for the whole run up front, so the state dict has the
same shapes in every task and federated averaging works; task-dependent behaviour (which prompts are active,
which get gradients) is set with `set_task`, and `start_task` (server side, once per task) does any
re-initialisation. `aux_loss` holds the last forward's auxiliary loss (0 when the method has none); the shared
training loss adds it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PromptPool(nn.Module):
    """Base class of query-conditioned prompt modules (see the module docstring)."""

    needs_query = True

    def __init__(self) -> None:
        super().__init__()
        self.task = 0
        self.aux_loss = torch.zeros(())
        self.selected: torch.Tensor | None = None

    def set_task(self, task: int) -> None:
        """Select the behaviour of `task` (active prompts, train-time selection); no parameter changes."""
        self.task = task

    def start_task(self, task: int) -> None:
        """Called once by the server when `task` begins: re-initialise what the method grows per task."""
        self.set_task(task)


def cosine(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, d) × (M, d) → (B, M) cosine similarities."""
    return F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).T


def uniform_(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
    with torch.no_grad():
        return t.uniform_(low, high)


def gram_schmidt_(t: torch.Tensor, start: int, end: int) -> None:
    """Re-draw rows [start, end) of `t` (flattened per row) orthonormal to each other and to rows [0, start).

    CODA-P's `gram_schmidt` for a new task's components. Rows beyond the flattened dimension cannot be
    orthogonal; they are left as normalised random vectors (CODA-P would divide by zero there).
    """
    with torch.no_grad():
        flat = t.view(t.shape[0], -1)
        dim = flat.shape[1]
        basis = [F.normalize(flat[i], dim=0) for i in range(min(start, dim))]
        for i in range(start, end):
            v = torch.randn(dim, dtype=flat.dtype, device=flat.device)
            if len(basis) < dim:
                for b in basis:
                    v = v - (v @ b) * b
            v = F.normalize(v, dim=0)
            if len(basis) < dim:
                basis.append(v)
            flat[i] = v
