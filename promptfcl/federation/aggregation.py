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
