"""RegMean (Jin et al., ICLR 2023), the merge LoRM uses: Gram regularisation, projection and the closed form."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Solve = Literal["pinv", "inverse"]


def regularize_gram(gram: torch.Tensor, decay: float) -> torch.Tensor:
    """RegMean's off-diagonal decay (Jin et al., ICLR 2023, §3.3): γ·G + (1 − γ)·diag(G). γ = 1 keeps G; γ = 0
    keeps only its diagonal, returned as the (n,) vector of that diagonal (all a diagonal Gram needs to travel)."""
    if not 0 <= decay <= 1:
        raise ValueError(f"Gram decay must be in [0, 1], got {decay}")
    if decay == 0:
        return gram.diagonal().clone() if gram.dim() == 2 else gram
    if gram.dim() == 1:
        raise ValueError("a diagonal Gram cannot be regularised with decay > 0 (its off-diagonals were not kept)")
    return decay * gram + (1 - decay) * torch.diag_embed(gram.diagonal())


def project_gram(a: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """A·G·Aᵀ for A (r, n) and a full (n, n) or diagonal (n,) Gram, in float64: the Gram of the inputs A·x."""
    g = gram.double()
    a = a.to(g.device, torch.float64)  # on the Gram's device (clients send Grams from the CPU)
    return (a * g) @ a.T if g.dim() == 1 else a @ g @ a.T


def regmean(weights: Sequence[torch.Tensor], grams: Sequence[torch.Tensor], solve: Solve = "pinv") -> torch.Tensor:
    """RegMean's closed-form merge W* = (Σ_k W_k·G_k)·(Σ_k G_k)⁻¹ of linear maps W_k (m, n) whose inputs have Gram
    matrices G_k = X_kᵀX_k (n, n) — the minimiser of Σ_k ‖X_k·W*ᵀ − X_k·W_kᵀ‖²_F. A diagonal Gram may be given
    as its (n,) diagonal (all must then be diagonal): every input column is then a weighted mean. Solved in
    float64, returned in W_0's dtype. `solve`: "pinv" (a pseudo-inverse: a direction no client's inputs reach
    gets 0) or "inverse" (`torch.linalg.inv`, as fed-mammoth merges LoRM's head; a singular sum raises)."""
    if not weights or len(weights) != len(grams):
        raise ValueError(f"regmean needs one Gram per weight, got {len(weights)} weights and {len(grams)} Grams")
    diagonal = grams[0].dim() == 1
    if any((g.dim() == 1) != diagonal for g in grams):
        raise ValueError("regmean: mix of diagonal and full Gram matrices")
    dev = grams[0].device  # solved where the Grams are; returned on W_0's device
    gs = [g.to(dev, torch.float64) for g in grams]
    ws = [w.to(dev, torch.float64) for w in weights]
    total = torch.stack(gs).sum(0)
    if diagonal:
        num = torch.stack([w * g for w, g in zip(ws, gs, strict=True)]).sum(0)
        if solve == "inverse":
            inv = 1.0 / total
        else:
            inv = torch.where(total > 0, 1.0 / total.clamp_min(1e-300), torch.zeros_like(total))
        return (num * inv).to(weights[0].device, weights[0].dtype)
    num = torch.stack([w @ g for w, g in zip(ws, gs, strict=True)]).sum(0)
    if solve == "inverse":
        try:
            inv = torch.linalg.inv(total)
        except torch.linalg.LinAlgError:
            raise ValueError(
                "regmean: the summed Gram matrix is singular, so it has no inverse (some input direction reaches no "
                "client); use a pseudo-inverse (LoRM: method.head_solve: pinv) or a Gram decay below 1"
            ) from None
    else:
        inv = torch.linalg.pinv(total, hermitian=True)
    return (num @ inv).to(weights[0].device, weights[0].dtype)
