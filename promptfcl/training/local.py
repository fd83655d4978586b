"""The local training loop shared by every client program: optimiser, schedule, masked CE, clipping."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from promptfcl.data.loader import LabeledSubset
from promptfcl.data.transforms import Augment, ImageTransform
from promptfcl.scenario.label_space import TrainLogits, masked_logits


class LocalTrainingParams(BaseModel):
    """Hyper-parameters of local training that most methods share (each method sets its paper's defaults)."""

    model_config = ConfigDict(extra="forbid")
    local_epochs: int = Field(5, gt=0)
    batch_size: int = Field(16, gt=0)
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(3e-3, gt=0)
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float | None = Field(1.0, gt=0)
    augment: Augment = "flip"
    train_logits: TrainLogits = "current_task"


def make_optimizer(p: LocalTrainingParams, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if p.optimizer == "sgd":
        return torch.optim.SGD(params, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
    cls = torch.optim.AdamW if p.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=p.lr, weight_decay=p.weight_decay)


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def masked_cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """CE over the logits allowed by `mask` (the others set to -inf)."""
    return F.cross_entropy(masked_logits(model(x), mask), y)


def train_local(
    model: nn.Module,
    data: LabeledSubset,
    p: LocalTrainingParams,
    mask: torch.Tensor,
    transform: ImageTransform,
    generator: torch.Generator,
    device: torch.device,
    loss_fn: LossFn = masked_cross_entropy,
) -> dict[str, float]:
    """`p.local_epochs` epochs of minibatch training on `data`; returns mean loss and counts."""
    params = [q for q in model.parameters() if q.requires_grad]
    opt = make_optimizer(p, params)
    steps_per_epoch = math.ceil(len(data) / p.batch_size)
    sched = (
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=p.local_epochs * steps_per_epoch)
        if p.lr_schedule == "cosine"
        else None
    )
    model.train()
    mask = mask.to(device)
    total, steps = 0.0, 0
    for _ in range(p.local_epochs):
        for x, y in data.batches(p.batch_size, transform, generator, shuffle=True, device=device):
            loss = loss_fn(model, x, y, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if p.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, p.grad_clip)
            opt.step()
            if sched is not None:
                sched.step()
            total += float(loss.detach())
            steps += 1
    model.eval()
    return {"loss": total / max(steps, 1), "steps": steps, "samples": len(data)}
