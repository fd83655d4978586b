"""Aggregation math shared by every method: (weighted) means of named-tensor dictionaries."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def weighted_mean(
    states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """Σ_k w_k·state_k / Σ_k w_k for every tensor name (uniform when `weights` is None).

    Sums are taken in float64 and cast back, so the result does not depend on summation order noise.
    """
    if not states:
        raise ValueError("nothing to aggregate")
    w = torch.ones(len(states), dtype=torch.float64) if weights is None else torch.tensor(weights, dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"aggregation weights must be non-negative with a positive sum, got {w.tolist()}")
    w = w / w.sum()
    names = states[0].keys()
    for s in states[1:]:
        if s.keys() != names:
            raise ValueError("clients returned different tensor names")
    out = {}
    for name in names:
        ref = states[0][name]
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for wk, s in zip(w, states, strict=True):
            acc += wk * s[name].double()
        out[name] = acc.to(ref.dtype)
    return out


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
    total = n.sum(0)
    w = n.view(*n.shape, *([1] * (x.ndim - 2)))
    mean = (w * x).sum(0) / total.clamp_min(1e-300).view(-1, *([1] * (x.ndim - 2)))
    fallback = keep.double() if keep is not None else x.mean(0)
    held = (total > 0).view(-1, *([1] * (x.ndim - 2)))
    return torch.where(held, mean, fallback).to(rows[0].dtype)
