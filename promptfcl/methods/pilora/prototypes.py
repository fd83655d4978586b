"""PILoRA's prototype re-weighting of client prototypes by their distance to the clients' class features."""

from __future__ import annotations

import torch


def prototype_reweight(
    prototypes: torch.Tensor, features: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PILoRA's prototype re-weighting of one class (Guo et al., ECCV 2024, §3.2; official `compute_weight`).

    `prototypes` (K, d): the class's prototype as trained by each of K clients; `features` (J, d): the class's
    mean feature on each of the J clients that hold it. Client k's prototype is scored by the reciprocal of its
    summed Euclidean distance to those features, s_k = 1 / Σ_j ‖m_k − f_j‖₂, scores are min-max normalised and
    w = softmax(ŝ / τ); the global prototype is Σ_k w_k·m_k. Without features (or with equal scores) every
    prototype weighs the same. Returns (global prototype (d,), weights (K,)), float64 sums, prototypes' dtype.
    """
    k = prototypes.shape[0]
    if k == 0:
        raise ValueError("no prototypes to re-weight")
    p = prototypes.double()
    if features.shape[0] == 0:
        w = torch.full((k,), 1.0 / k, dtype=torch.float64, device=p.device)
    else:
        score = 1.0 / torch.cdist(p, features.to(p.device, torch.float64)).sum(1).clamp_min(1e-12)
        span = score.max() - score.min()
        norm = (score - score.min()) / span if span > 0 else torch.zeros_like(score)
        w = torch.softmax(norm / temperature, dim=0)
    return (w @ p).to(prototypes.dtype), w

