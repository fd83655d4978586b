"""Batched image transforms on uint8 tensors: resize, augment and normalise in one pass on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Augment = Literal["none", "flip", "crop_flip"]


@dataclass(frozen=True)
class ImageTransform:
    """uint8 (B,3,h,w) → normalised float (B,3,S,S); train-time augmentation draws from a given generator.

    `flip`: random horizontal flip. `crop_flip`: flip plus a random translation of up to `max_shift`
    (fraction of the side) with reflection padding, the usual pad-and-crop. Both are done for the whole batch
    with one `grid_sample`, so there is no per-sample Python loop.
    """

    img_size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    augment: Augment = "none"
    max_shift: float = 0.125

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        x = images.float().div_(255.0)
        if self.augment == "none" or generator is None:
            if x.shape[-1] != self.img_size or x.shape[-2] != self.img_size:
                x = F.interpolate(
                    x, size=(self.img_size, self.img_size), mode=self.interpolation, align_corners=False
                ).clamp_(0, 1)
        else:
            x = self._augment(x, generator)
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    def _augment(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        b = x.shape[0]
        flip = torch.where(torch.rand(b, generator=gen) < 0.5, -1.0, 1.0)
        shift = torch.zeros(b, 2)
        if self.augment == "crop_flip":
            shift = (torch.rand(b, 2, generator=gen) * 2 - 1) * (2 * self.max_shift)
        theta = torch.zeros(b, 2, 3)
        theta[:, 0, 0] = flip
        theta[:, 1, 1] = 1.0
        theta[:, :, 2] = shift
        theta = theta.to(x.device)
        grid = F.affine_grid(theta, [b, 3, self.img_size, self.img_size], align_corners=False)
        return F.grid_sample(x, grid, mode=self.interpolation, padding_mode="reflection", align_corners=False).clamp_(
            0, 1
        )
