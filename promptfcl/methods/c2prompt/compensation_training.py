"""C2Prompt's LCDC training loop: fit the compensation prompts to the global class Gaussians (frozen backbone)."""

from __future__ import annotations

import torch

from promptfcl.backbones.precision import LossScaler
from promptfcl.backbones.vit import FrozenViT
from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import ImageTransform
from promptfcl.methods.c2prompt.compensation_prompts import CompensationPrompts, gaussian_nll


@torch.no_grad()
def mean_nll(
    backbone: FrozenViT,
    prompts: CompensationPrompts | None,
    data: LabeledSubset,
    index_of: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    transform: ImageTransform,
    device: torch.device,
    eps: float,
    batch_size: int = 128,
) -> float:
    """Mean NLL of the (compensated, if `prompts`) features of `data` under their classes' Gaussians."""
    total, n = 0.0, 0
    for x, y in data.batches(nograd_batch(device, batch_size), transform, device=device):
        i = index_of[y.cpu()]
        keep = i >= 0
        if not keep.any():
            continue
        x, i = x[keep.to(x.device)], i[keep]
        f = backbone(x, prompts.spec(i.to(device)) if prompts is not None else None)
        total += float(gaussian_nll(f.cpu().double(), mean[i].double(), var[i].double(), eps).sum())
        n += len(i)
    return total / max(n, 1)


def train_compensation(
    backbone: FrozenViT,
    prompts: CompensationPrompts,
    data: LabeledSubset,
    index_of: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    transform: ImageTransform,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    eps: float = 1e-4,
    diagnostic_samples: int | None = None,
) -> dict[str, float]:
    """Adam on the prompts only; `index_of[logit]` is the prompt / Gaussian row of a sample's class (−1: no global
    statistics, sample skipped). Returns, on the first `diagnostic_samples` samples (all when None; 0 skips the
    measurement), the mean NLL under the global Gaussians of the unprompted feature q(x) (`lcdc_nll_unprompted`,
    what LCDC must improve on), of the feature with the freshly initialised prompts (`lcdc_nll_before`) and with
    the trained ones (`lcdc_nll_after`)."""
    n = len(data) if diagnostic_samples is None else min(diagnostic_samples, len(data))
    probe = data.head(n)
    unprompted = mean_nll(backbone, None, probe, index_of, mean, var, transform, device, eps) if n else None
    before = mean_nll(backbone, prompts, probe, index_of, mean, var, transform, device, eps) if n else float("nan")
    opt = torch.optim.Adam(prompts.parameters(), lr=lr)
    scaler = LossScaler(backbone.precision, device)  # fp16: loss scaling through the backbone
    mean, var = mean.to(device), var.to(device)
    for _ in range(epochs):
        for x, y in data.batches(batch_size, transform, generator, shuffle=True, device=device):
            i = index_of[y.cpu()].to(device)
            keep = i >= 0
            if not keep.any():
                continue
            x, i = x[keep], i[keep]
            loss = gaussian_nll(backbone(x, prompts.spec(i)), mean[i], var[i], eps).mean()
            opt.zero_grad(set_to_none=True)
            scaler.backward(loss)
            scaler.step(opt, prompts.parameters(), None)
    after = mean_nll(backbone, prompts, probe, index_of, mean.cpu(), var.cpu(), transform, device, eps) if n else None
    if after is None or unprompted is None:
        return {}
    return {"lcdc_nll_unprompted": unprompted, "lcdc_nll_before": before, "lcdc_nll_after": after}
