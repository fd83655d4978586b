"""The local training loop shared by every client program: optimiser, schedule, masked CE, clipping."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from promptfcl.backbones.precision import LossScaler
from promptfcl.backbones.vit import stem_cache_for
from promptfcl.data.loader import LabeledSubset
from promptfcl.data.transforms import Augment, ImageTransform
from promptfcl.scenario.label_space import TrainLogits, masked_logits


class LocalTrainingParams(BaseModel):
    """Hyper-parameters of local training that most methods share (each method sets its paper's defaults)."""

    model_config = ConfigDict(extra="forbid")
    local_epochs: int = Field(5, gt=0)
    batch_size: int = Field(16, gt=0)
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(3e-3, ge=0, description="0: the clients do not learn (a control the validity gate must flag)")
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    lr_schedule: Literal["constant", "cosine", "coda_cosine"] = Field(
        "constant",
        description="cosine: per step to 0; coda_cosine: per epoch lr·cos(99π·e / (200·(E−1))) (CODA-P/HePCo code)",
    )
    grad_clip: float | None = Field(1.0, gt=0)
    augment: Augment = Field(
        "flip",
        description="training augmentation: none | flip | crop_flip (flip + a reflection-padded translation) | "
        "rrc_flip (RandomResizedCrop + flip, as the official fed-mammoth / HePCo codes)",
    )
    train_logits: TrainLogits = "current_task"
    optimizer_reset: Literal["round", "never"] = Field(
        "round", description="new optimizer every round, or keep its state in the client's state across rounds"
    )


def coda_cosine_factor(epoch: int, epochs: int) -> float:
    """CODA-P's per-epoch cosine decay, reused by HePCo: cos(99π·e / (200·(E−1))), 1 when E = 1."""
    return 1.0 if epochs <= 1 else math.cos(99 * math.pi * epoch / (200 * (epochs - 1)))


def make_optimizer(p: LocalTrainingParams, params: list[nn.Parameter] | list[dict]) -> torch.optim.Optimizer:
    """`p`'s optimizer over `params`: parameters, or torch param groups (a group's own `lr` overrides `p.lr`)."""
    if p.optimizer == "sgd":
        return torch.optim.SGD(params, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
    cls = torch.optim.AdamW if p.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=p.lr, weight_decay=p.weight_decay)


OPTIM_PREFIX = "optim/"


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as named tensors (`optim/<param index>/<name>`), for a Record."""
    out = {}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"{OPTIM_PREFIX}{i}/{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Load state saved by `optimizer_tensors` (hyper-parameters stay those `opt` was built with)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        if name.startswith(OPTIM_PREFIX):
            i, k = name[len(OPTIM_PREFIX) :].split("/", 1)
            state.setdefault(int(i), {})[k] = v.clone()
    if state:
        sd = opt.state_dict()
        sd["state"] = state
        opt.load_state_dict(sd)


class LossTerms(NamedTuple):
    """A training loss (`total`, what is minimised) and its classification cross-entropy (`ce`): the part the
    validity gate compares with the label-prior loss. Auxiliary terms (key pulls, orthogonality, proximal or
    distillation terms) have no such scale and stay out of `ce`."""

    total: torch.Tensor
    ce: torch.Tensor


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | LossTerms"]


def cross_entropy_terms(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> LossTerms:
    """CE over the logits allowed by `mask` (the others set to -inf), plus the prompt pool's auxiliary loss
    (L2P/DualPrompt key matching, CODA-P orthogonality) when the model has one; the CE alone beside it."""
    ce = F.cross_entropy(masked_logits(model(x), mask), y)
    aux = getattr(getattr(model, "prompt", None), "aux_loss", None)
    return LossTerms(ce + aux if aux is not None and aux.requires_grad else ce, ce)


def masked_cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The total of `cross_entropy_terms`: masked CE plus the prompt pool's auxiliary loss."""
    return cross_entropy_terms(model, x, y, mask).total


def train_local(
    model: nn.Module,
    data: LabeledSubset,
    p: LocalTrainingParams,
    mask: torch.Tensor,
    transform: ImageTransform,
    generator: torch.Generator,
    device: torch.device,
    loss_fn: LossFn = cross_entropy_terms,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, float]:
    """`p.local_epochs` epochs of minibatch training on `data`; returns the mean loss, the final epoch's mean
    classification loss (`last_loss`: the CE of `LossTerms` when `loss_fn` returns them, else the whole loss; the
    final epoch's whole loss is `last_total`), ln K of the K logits that compete (`chance_loss`, a uniform guess's
    CE), the entropy of the client's own labels (`prior_loss`: the CE of always predicting its label distribution,
    what a model that learned only the client's label prior reaches) and counts — the validity gate's evidence that
    the client learned (`evaluation.validity`).

    A fresh optimizer is made from `p` unless `optimizer` (e.g. one restored from the client's state) is given.
    """
    params = [q for q in model.parameters() if q.requires_grad]
    opt = optimizer if optimizer is not None else make_optimizer(p, params)
    steps_per_epoch = math.ceil(len(data) / p.batch_size)
    sched = (
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=p.local_epochs * steps_per_epoch)
        if p.lr_schedule == "cosine"
        else None
    )
    model.train()
    mask = mask.to(device)
    scaler = LossScaler.for_model(model, device)  # fp16: dynamic loss scaling; otherwise plain backward / step
    # loss sums stay on the device (float64: the same sums as Python floats), read once: no sync per step on a GPU
    total = epoch_total = epoch_ce = torch.zeros((), dtype=torch.float64, device=device)
    steps = epoch_steps = 0
    with stem_cache_for(getattr(model, "backbone", None), transform):  # random crops: the stem runs batched
        for epoch in range(p.local_epochs):
            epoch_total = epoch_ce = torch.zeros((), dtype=torch.float64, device=device)
            epoch_steps = 0
            if p.lr_schedule == "coda_cosine":
                for g in opt.param_groups:  # relative to each group's own lr
                    g["lr"] = g.setdefault("base_lr", g["lr"]) * coda_cosine_factor(epoch, p.local_epochs)
            for x, y in data.batches(p.batch_size, transform, generator, shuffle=True, device=device):
                terms = loss_fn(model, x, y, mask)
                loss, ce = terms if isinstance(terms, LossTerms) else (terms, terms)
                opt.zero_grad(set_to_none=True)
                scaler.backward(loss)
                scaler.step(opt, params, p.grad_clip)
                if sched is not None:
                    sched.step()
                value = loss.detach().double()
                total, epoch_total = total + value, epoch_total + value
                epoch_ce = epoch_ce + ce.detach().double()
                steps, epoch_steps = steps + 1, epoch_steps + 1
    model.eval()
    out = {
        "loss": float(total) / max(steps, 1),
        "last_loss": float(epoch_ce) / max(epoch_steps, 1),
        "last_total": float(epoch_total) / max(epoch_steps, 1),
        "chance_loss": chance_loss(mask),
        "steps": steps,
        "samples": len(data),
    }
    targets = getattr(data, "targets", None)  # data without labels at hand (a test's stand-in) reports no prior
    if targets is not None:
        out["prior_loss"] = prior_loss(targets)
    return out


def prior_loss(targets: torch.Tensor) -> float:
    """The entropy (nats) of a client's label distribution: the cross-entropy of predicting, for every sample, the
    client's own label frequencies — the loss a model reaches by learning only the label prior."""
    if len(targets) == 0:
        return 0.0
    freq = torch.bincount(targets.flatten().long()).double()
    freq = freq[freq > 0] / len(targets)
    return float(-(freq * freq.log()).sum())


def scale_free_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(min over one positive scale s of CE(s · logits, targets), that s), s on a log grid from 1/8 to 4096 that holds
    1: the fit of logits whose scale a method fixes by construction (PILoRA's −d/T), comparable with `prior_loss` —
    a predictor that ignores its input cannot go below the entropy of the labels at any scale, so the comparison
    keeps its meaning while the scale drops out. Rows of -inf (masked logits) stay masked."""
    if len(targets) == 0:
        return 0.0, 1.0
    logits, targets = logits.detach().double(), targets.long()
    best = (math.inf, 1.0)
    for k in range(-24, 97):
        scale = 2.0 ** (k / 8)
        best = min(best, (float(F.cross_entropy(logits * scale, targets)), scale))
    return best


def own_class_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """`scale_free_loss` over only the columns of the classes present in `targets` (the client's own classes): the fit
    of a classifier without a per-class bias (PILoRA's nearest prototype), whose probability mass cannot be moved
    onto a client's classes except through its input. Still held to `prior_loss`: a predictor that ignores its
    input cannot go below the labels' entropy over these columns either, at any scale."""
    if len(targets) == 0:
        return 0.0, 1.0
    own = torch.unique(targets.long())
    return scale_free_loss(logits[:, own.to(logits.device)], torch.searchsorted(own, targets.long()))


def chance_loss(mask: torch.Tensor) -> float:
    """ln K, K the logits `mask` lets compete: the cross-entropy of a uniform guess."""
    return math.log(max(int(mask.sum()), 1))
