"""Server-side classifier retraining on sampled features (HGP's rebalancing, CCVR's calibration).

Only the rows of the linear head that belong to the allowed logits are updated: they are optimised as a copy
and written back, so weight decay and momentum cannot touch the other rows (fed-mammoth's CR_cur / CR_old
slice the head the same way; SGD weight decay over the whole head would shrink the other rows too). Each
epoch draws N = `samples_per_class` × #classes fresh features from the sampler and takes ⌈N / `batch_size`⌉
SGD steps over them (HGP: 256 per class and batch 256, so one step per class). Loss: CE over the allowed
logits; with `logit_norm_temperature=τ` the allowed logits are first divided by their L2 norm and by τ (HGP
code; SLCA-style logit normalisation).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from promptfcl.statistics.mixture import MixtureSampler


class CalibrationParams(BaseModel):
    """How the head is retrained on sampled features."""

    model_config = ConfigDict(extra="forbid")
    epochs: int = Field(5, ge=0)
    samples_per_class: int = Field(256, gt=0, description="average draws per class and epoch")
    batch_size: int = Field(256, gt=0)
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    logit_norm_temperature: float | None = Field(0.1, gt=0, description="None: plain CE on raw logits")


def normalized_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / ‖logits‖₂ / τ, row-wise (HGP code: unit-norm logits scaled by 1/τ)."""
    return logits / (logits.norm(dim=-1, keepdim=True) + 1e-7) / temperature


def calibrate_head(
    head: nn.Linear,
    sampler: MixtureSampler,
    allowed_logits: torch.Tensor,
    p: CalibrationParams,
    gen: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    """Retrain the `allowed_logits` rows of `head` in place with SGD on features drawn from `sampler`; returns the
    last epoch's mean loss. The other rows are left exactly as they were.

    `allowed_logits` (long ids) are the logits that compete (e.g. all seen classes); every sampled class must be
    among them.
    """
    allowed = allowed_logits.to(device)
    remap = torch.full((head.out_features,), -1, dtype=torch.long, device=device)
    remap[allowed] = torch.arange(len(allowed), device=device)
    n = p.samples_per_class * len(sampler.classes)
    steps = p.epochs * math.ceil(n / p.batch_size)
    if steps == 0:
        return {"calibration_loss": float("nan")}
    weight = nn.Parameter(head.weight.detach()[allowed].clone())  # (len(allowed), d): the rows that compete
    bias = None if head.bias is None else nn.Parameter(head.bias.detach()[allowed].clone())
    params = [weight] if bias is None else [weight, bias]
    opt = torch.optim.SGD(params, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps) if p.schedule == "cosine" else None
    last = 0.0
    for _ in range(p.epochs):
        feats, labels = sampler.sample(n, gen)
        targets = remap[labels.to(device)]
        if (targets < 0).any():
            raise ValueError("sampled a class outside the allowed logits")
        feats = feats.to(device)
        total = 0.0
        for s in range(0, n, p.batch_size):
            logits = F.linear(feats[s : s + p.batch_size], weight, bias)
            if p.logit_norm_temperature is not None:
                logits = normalized_logits(logits, p.logit_norm_temperature)
            loss = F.cross_entropy(logits, targets[s : s + p.batch_size])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            total += float(loss.detach()) * len(logits)
        last = total / n
    with torch.no_grad():
        head.weight[allowed] = weight.detach()
        if bias is not None:
            head.bias[allowed] = bias.detach()
    return {"calibration_loss": last}
