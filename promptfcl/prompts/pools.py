"""Shared machinery of query-conditioned prompt pools (L2P, DualPrompt, CODA-P, HePCo's weighted pool).

Protocol. A pool is a prompt module with `needs_query = True`: `forward(batch_size, q)` turns the unprompted
query q(x) (frozen final-norm CLS, no grad) into a `PromptSpec`. Every learnable tensor is an `nn.Parameter`
allocated for the whole run up front, so `state_dict()` has the same shapes in every task and federated averaging
works; per-task growth is a mask over that fixed pool. `set_task(t)` (a plain int attribute, not in the state
dict: call it again after `load_state_dict`) selects task t's behaviour and performs, once, any per-task
(re-)initialisation; `start_task` is the same call under the name the servers use. After each forward,
`aux_loss` holds that forward's auxiliary loss (a zero scalar when the method has none, or in eval mode) and
`selected` the chosen prompt ids (None for pools that weight rather than select).

Shared math: cosine similarity, top-k selection with L2P's batch-wise voting (Wang et al., CVPR 2022, §4.2;
official `batchwise_prompt`), and CODA-P's Gram–Schmidt initialisation of a new task's block (Smith et al.,
CVPR 2023, §4.2 "orthogonality"; official `CodaPrompt.gram_schmidt`).

Deviation (Gram–Schmidt): CODA-P's code subtracts projections onto the *raw* earlier rows, which after training
are no longer orthonormal, so its new rows are only approximately orthogonal to the old ones. Here the earlier
rows are orthonormalised first (for the projection only; they are not modified), so new rows are exactly
orthogonal to their span. Rows beyond the flattened dimension cannot be orthogonal; they are left as normalised
random vectors (CODA-P's code would divide by ~0 there).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class PromptPool(nn.Module):
    """Base class of query-conditioned prompt modules: task index, last auxiliary loss, last selection."""

    needs_query = True

    def __init__(self) -> None:
        super().__init__()
        self.task = 0
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.selected: torch.Tensor | None = None

    def set_task(self, task: int) -> None:
        """Serve `task`: which prompts are active / trainable; subclasses also grow the pool here (once)."""
        if task < 0:
            raise ValueError(f"task index must be non-negative, got {task}")
        self.task = int(task)

    def start_task(self, task: int) -> None:
        """The server's call when `task` begins (same as `set_task`, which is idempotent)."""
        self.set_task(task)

    def __getstate__(self) -> dict[str, Any]:
        # `aux_loss` of a training forward is a graph node, which `copy.deepcopy` / pickle refuse
        state = dict(super().__getstate__())
        state["aux_loss"] = self.aux_loss.detach()
        return state

    def _no_aux(self, like: torch.Tensor) -> None:
        self.aux_loss = like.new_zeros(())


def require_query(pool: nn.Module, query: torch.Tensor | None) -> torch.Tensor:
    """The query, or a clear error when the model did not pass one."""
    if query is None:
        raise ValueError(f"{type(pool).__name__} needs the query q(x) (needs_query = True)")
    return query


def cosine(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, d) × (M, d) → (B, M) cosine similarities."""
    return F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).T


def top_k_ids(sim: torch.Tensor, k: int, batchwise: bool = False) -> torch.Tensor:
    """(B, k) ids of the k highest similarities per row (-inf entries are never chosen while others remain).

    With `batchwise` (L2P's `batchwise_prompt`), the k ids chosen most often in the batch serve every sample;
    ties go to the lower id.
    """
    ids = sim.topk(k, dim=1).indices
    if not batchwise:
        return ids
    counts = torch.bincount(ids.flatten(), minlength=sim.shape[1])
    major = torch.sort(counts, descending=True, stable=True).indices[:k]
    return major.unsqueeze(0).expand(sim.shape[0], -1)


def uniform_(t: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """In-place U(low, high) without autograd; returns `t`."""
    with torch.no_grad():
        return t.uniform_(low, high)


def _residual(v: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """v minus its projection on the orthonormal rows of `basis` (twice, for numerical orthogonality)."""
    for _ in range(2):
        v = v - basis.T @ (basis @ v)
    return v


@torch.no_grad()
def gram_schmidt_(t: torch.Tensor, start: int, end: int) -> None:
    """Redraw rows [start, end) of `t` (each row flattened) as orthonormal random vectors ⟂ rows [0, start).

    CODA-P's per-task initialisation of a new block of components, keys or attention vectors.
    """
    flat = t.view(t.shape[0], -1)
    dim = flat.shape[1]
    basis = flat.new_zeros(0, dim)
    for row in flat[:start]:  # orthonormal basis of the earlier rows' span
        r = _residual(row, basis)
        if r.norm() > 1e-6 * row.norm().clamp_min(1e-12):
            basis = torch.cat([basis, F.normalize(r, dim=0)[None]])
    for i in range(start, end):
        v = torch.randn(dim, dtype=flat.dtype, device=flat.device)
        if len(basis) < dim:
            v = F.normalize(_residual(v, basis), dim=0)
            basis = torch.cat([basis, v[None]])
        flat[i] = F.normalize(v, dim=0)
