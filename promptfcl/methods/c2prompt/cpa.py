"""C2Prompt's class-aware prompt aggregation (CPA) maths: client affinities from class histograms, row mixing."""

from __future__ import annotations

import torch


def class_affinity_weights(hist: torch.Tensor, temperature: float, norm: str = "centered_l2") -> torch.Tensor:
    """C2Prompt's CPA weights W = row-softmax(H Hᵀ / τ) for stacked prompt-class histograms H (rows, classes).

    `norm` (the sources are silent): `centered_l2` subtracts from every row the mean row of its client block
    (pass `hist` as (clients, N, classes) for that) and L2-normalises rows, so H Hᵀ is the cosine of relative
    class affinities; `l2` L2-normalises raw rows; `l1` divides rows by their absolute sum; `none` uses H as is.
    Returns (rows, rows) with rows summing to one.
    """
    h = hist.double()
    if norm == "centered_l2":
        if h.dim() != 3:
            raise ValueError("centered_l2 needs the histograms as (clients, components, classes)")
        h = h - h.mean(dim=1, keepdim=True)
    h = h.reshape(-1, h.shape[-1])
    if norm in ("centered_l2", "l2"):
        h = torch.nn.functional.normalize(h, dim=1)
    elif norm == "l1":
        h = h / h.abs().sum(dim=1, keepdim=True).clamp_min(1e-12)
    elif norm != "none":
        raise ValueError(f"unknown histogram normalisation {norm!r}")
    return torch.softmax(h @ h.T / temperature, dim=1)


def mix_rows(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """W · P for stacked rows P (R, …): every output row a convex combination of the inputs (float64 sums)."""
    flat = rows.reshape(rows.shape[0], -1).double()
    return (weights.to(flat.device, torch.float64) @ flat).reshape(rows.shape).to(rows.dtype)

