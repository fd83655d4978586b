"""Loss terms several methods add to local training: proximal (FedProx) and LwF.MC distillation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def proximal_term(model: nn.Module, reference: dict[str, torch.Tensor], mu: float) -> torch.Tensor:
    """(μ/2)·Σ‖w − w_ref‖² over the trainable parameters (FedProx, Li et al. 2020, Eq. 2)."""
    total = torch.zeros(())
    for name, w in model.named_parameters():
        if w.requires_grad:
            total = total + (w - reference[name].to(w.device)).pow(2).sum()
    return 0.5 * mu * total


def lwf_mc_loss(
    logits: torch.Tensor, targets: torch.Tensor, old_logits: torch.Tensor | None, old: int, seen: int
) -> torch.Tensor:
    """LwF.MC / iCaRL's multi-class distillation (Rebuffi et al. 2017, Eq. 1 with a previous network).

    Binary cross-entropy over the seen logits [0, seen): new-class logits [old, seen) against the one-hot label,
    old-class logits [0, old) against the previous model's sigmoid outputs. Averaged over samples and logits.
    """
    target = F.one_hot(targets, logits.shape[1]).float()[:, :seen]
    if old_logits is not None and old > 0:
        target[:, :old] = torch.sigmoid(old_logits[:, :old])
        return F.binary_cross_entropy_with_logits(logits[:, :seen], target)
    return F.binary_cross_entropy_with_logits(logits[:, old:seen], target[:, old:seen])
