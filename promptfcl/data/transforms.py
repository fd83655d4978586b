"""Batched image transforms on uint8 tensors: resize, augment and normalise in one pass on the device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Augment = Literal["none", "flip", "crop_flip", "rrc_flip"]
RRC_ATTEMPTS = 10  # crop draws per image before falling back to the whole image (torchvision / kornia)


@dataclass(frozen=True)
class ImageTransform:
    """uint8 (B,3,h,w) → normalised float (B,3,S,S); train-time augmentation draws from a given generator.

    `flip`: random horizontal flip. `crop_flip`: flip plus a random translation of up to `max_shift`
    (fraction of the side) with reflection padding, the usual pad-and-crop. `rrc_flip`: RandomResizedCrop then
    flip, as fed-mammoth's kornia pipelines (`K.RandomResizedCrop(size, resample="bicubic")`,
    `K.RandomHorizontalFlip()`) and HePCo's torchvision ones do: per image, up to `RRC_ATTEMPTS` draws of an area
    fraction a ~ U(`rrc_scale`) and an aspect ratio r with log r ~ U(log `rrc_ratio`), crop side fractions
    w = √(a·r), h = √(a/r); the first draw that fits (w, h ≤ 1) is used, else the whole image; its position is
    uniform over the places it fits; the crop is resized to `img_size` with `interpolation`. Every mode is done
    for the whole batch with one `grid_sample` (crop, resize and flip as one affine map), so there is no
    per-sample Python loop, and draws only from the given generator.
    """

    img_size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    augment: Augment = "none"
    max_shift: float = 0.125
    rrc_scale: tuple[float, float] = (0.08, 1.0)
    rrc_ratio: tuple[float, float] = (3 / 4, 4 / 3)

    @property
    def repeats(self) -> bool:
        """Whether an augmented image can come out again (no augmentation, or a flip: two variants per image); a
        random crop or shift gives a new input every time, so caching the frozen stem's output for it is useless."""
        return self.augment in ("none", "flip")

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.augment == "none" or generator is None:
            x = self.resized(images)
        else:
            x = self._augment(images.float().div_(255.0), generator)
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    def resized(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (B,3,h,w) → float (B,3,S,S) in [0, 1], resized with `interpolation` when h, w ≠ S: the evaluation
        path before normalisation (what `promptfcl export-scenario` writes, quantised to uint8)."""
        x = images.float().div_(255.0)
        if x.shape[-1] != self.img_size or x.shape[-2] != self.img_size:
            x = F.interpolate(
                x, size=(self.img_size, self.img_size), mode=self.interpolation, align_corners=False
            ).clamp_(0, 1)
        return x

    def _augment(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        b = x.shape[0]
        flip = torch.where(torch.rand(b, generator=gen) < 0.5, -1.0, 1.0)
        shift = torch.zeros(b, 2)
        scale = torch.ones(b, 2)
        if self.augment == "crop_flip":
            shift = (torch.rand(b, 2, generator=gen) * 2 - 1) * (2 * self.max_shift)
        elif self.augment == "rrc_flip":
            scale = self.crop_sides(b, gen)
            shift = (torch.rand(b, 2, generator=gen) * 2 - 1) * (1 - scale)  # the crop stays inside the image
        theta = torch.zeros(b, 2, 3)
        theta[:, 0, 0] = flip * scale[:, 0]
        theta[:, 1, 1] = scale[:, 1]
        theta[:, :, 2] = shift
        theta = theta.to(x.device)
        grid = F.affine_grid(theta, [b, 3, self.img_size, self.img_size], align_corners=False)
        return F.grid_sample(x, grid, mode=self.interpolation, padding_mode="reflection", align_corners=False).clamp_(
            0, 1
        )

    def crop_sides(self, b: int, gen: torch.Generator) -> torch.Tensor:
        """(b, 2) RandomResizedCrop side fractions (w, h) of the image: the first of `RRC_ATTEMPTS` draws per
        image that fits, else (1, 1), the whole image (torchvision's fallback for a square image)."""
        lo, hi = self.rrc_scale
        area = lo + (hi - lo) * torch.rand(b, RRC_ATTEMPTS, generator=gen)
        log_lo, log_hi = math.log(self.rrc_ratio[0]), math.log(self.rrc_ratio[1])
        ratio = torch.exp(log_lo + (log_hi - log_lo) * torch.rand(b, RRC_ATTEMPTS, generator=gen))
        w, h = (area * ratio).sqrt(), (area / ratio).sqrt()
        fits = (w <= 1) & (h <= 1)
        first = fits.int().argmax(dim=1)  # the first fitting draw (0 when none fits: replaced below)
        rows = torch.arange(b)
        sides = torch.stack([w[rows, first], h[rows, first]], dim=1)
        return torch.where(fits.any(dim=1, keepdim=True), sides, torch.ones(b, 2))
