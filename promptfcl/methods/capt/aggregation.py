"""CAPT's class-wise aggregation of class-aware prompts: each class row from the clients holding that class."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def classwise_mean(
    rows: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-class weighted mean of class-indexed tensors (C, ...): row c = Σ_k n_k(c)·X_k[c] / Σ_k n_k(c).

    For class-aware prompts only the clients holding class c trained row c, so they alone set it. Rows that no
    client holds take `keep[c]` when given (the previous value), else the uniform mean. Sums in float64.
    """
    if not rows:
        raise ValueError("nothing to aggregate")
    x = torch.stack([r.double() for r in rows])  # (K, C, ...)
    n = torch.stack([c.double() for c in counts])  # (K, C)
    if n.shape != x.shape[:2] or (n < 0).any():
        raise ValueError(f"counts must be non-negative with shape (clients, classes) = {tuple(x.shape[:2])}")
    n = n.to(x.device)  # label counts come from the CPU, the rows may sit on a GPU
    total = n.sum(0)
    w = n.view(*n.shape, *([1] * (x.ndim - 2)))
    mean = (w * x).sum(0) / total.clamp_min(1e-300).view(-1, *([1] * (x.ndim - 2)))
    fallback = keep.to(x.device, torch.float64) if keep is not None else x.mean(0)
    held = (total > 0).view(-1, *([1] * (x.ndim - 2)))
    return torch.where(held, mean, fallback).to(rows[0].dtype)

