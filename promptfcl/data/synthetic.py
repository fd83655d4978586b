"""A procedurally generated, class-structured image dataset: offline, deterministic, learnable.

Each class is a prototype made of a background colour plus a few coloured Gaussian blobs at class-specific
places; each sample shifts the blobs, rescales contrast and adds pixel noise. A frozen *random* ViT plus
prompts and a linear head separates the classes, which is what the tests and the offline quickstart need.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from promptfcl.data.base import DatasetSpec, ImageDataset, ImageSplit, register_dataset


class SyntheticOptions(BaseModel):
    """Size and difficulty of the synthetic dataset."""

    model_config = ConfigDict(extra="forbid")
    num_classes: int = Field(20, gt=1)
    train_per_class: int = Field(100, gt=0)
    test_per_class: int = Field(40, gt=0)
    image_size: int = Field(32, ge=8)
    blobs: int = Field(3, gt=0)
    max_shift: int = Field(3, ge=0, description="per-sample blob displacement in pixels")
    noise: float = Field(0.08, ge=0)
    seed: int = 1234


def _render(
    centers: torch.Tensor, sigmas: torch.Tensor, colors: torch.Tensor, bg: torch.Tensor, size: int
) -> torch.Tensor:
    """centers (N,K,2), sigmas (N,K), colors (N,K,3), bg (N,3) → float images (N,3,S,S) in [0,1]."""
    coords = torch.arange(size, dtype=torch.float32)
    dy = (coords.view(1, 1, size, 1) - centers[..., 1, None, None]) ** 2
    dx = (coords.view(1, 1, 1, size) - centers[..., 0, None, None]) ** 2
    w = torch.exp(-(dx + dy) / (2 * sigmas[..., None, None] ** 2))  # (N,K,S,S)
    img = bg[:, :, None, None] * (1 - w.sum(1, keepdim=True).clamp(max=1))
    img = img + torch.einsum("nkhw,nkc->nchw", w, colors)
    return img.clamp(0, 1)


def make_split(
    o: SyntheticOptions, per_class: int, gen: torch.Generator, protos: dict[str, torch.Tensor]
) -> ImageSplit:
    n = o.num_classes * per_class
    labels = torch.arange(o.num_classes).repeat_interleave(per_class)
    shift = (torch.rand(n, o.blobs, 2, generator=gen) * 2 - 1) * o.max_shift
    centers = protos["centers"][labels] + shift
    contrast = 0.8 + 0.4 * torch.rand(n, 1, 1, generator=gen)
    colors = (protos["colors"][labels] * contrast).clamp(0, 1)
    img = _render(centers, protos["sigmas"][labels], colors, protos["bg"][labels], o.image_size)
    img = img + o.noise * torch.randn(img.shape, generator=gen)
    return ImageSplit((img.clamp(0, 1) * 255).round().to(torch.uint8), labels)


def load_synthetic(root: Path, options: SyntheticOptions, download: bool) -> ImageDataset:
    o = options
    gen = torch.Generator().manual_seed(o.seed)
    s = o.image_size
    protos = {
        "centers": torch.rand(o.num_classes, o.blobs, 2, generator=gen) * (s * 0.7) + s * 0.15,
        "sigmas": torch.rand(o.num_classes, o.blobs, generator=gen) * (s / 8) + s / 12,
        "colors": torch.rand(o.num_classes, o.blobs, 3, generator=gen),
        "bg": torch.rand(o.num_classes, 3, generator=gen) * 0.6,
    }
    train = make_split(o, o.train_per_class, gen, protos)
    test = make_split(o, o.test_per_class, gen, protos)
    return ImageDataset("synthetic", train, test, [f"class_{i:03d}" for i in range(o.num_classes)])


register_dataset(
    DatasetSpec(
        "synthetic",
        "synthetic",
        load_synthetic,
        lambda root, o: None,
        lambda o: o.num_classes,
        SyntheticOptions,
        needs_root=False,
    )
)
