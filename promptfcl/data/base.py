"""In-memory image datasets: decoded once into uint8 tensors, plus the dataset registry."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from promptfcl.registry import Registry


class DataMissingError(FileNotFoundError):
    """A dataset's files are not where the config says; the message names the folder and files expected."""


@dataclass
class ImageSplit:
    """One split: uint8 images (N, 3, H, W) and int64 class ids (N,)."""

    images: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4 or self.images.shape[1] != 3:
            raise ValueError(f"images must be uint8 (N, 3, H, W), got {self.images.dtype} {tuple(self.images.shape)}")
        if self.targets.shape != (self.images.shape[0],):
            raise ValueError("targets must have one entry per image")
        self.targets = self.targets.long()

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def subset(self, indices: np.ndarray | torch.Tensor) -> ImageSplit:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return ImageSplit(self.images[idx].contiguous(), self.targets[idx].clone())


@dataclass
class ImageDataset:
    """A decoded dataset with train and test splits and class names."""

    name: str
    train: ImageSplit
    test: ImageSplit
    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


class NoOptions(BaseModel):
    """Options model for datasets that take none."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class DatasetSpec:
    """How to find, check and decode one dataset.

    `check(root, options)` must be cheap (file existence only) and raise `DataMissingError` with the expected
    layout; `load(root, options, download)` decodes everything into an `ImageDataset`; `num_classes(options)`
    lets configs be validated without decoding.
    """

    name: str
    folder: str
    load: Callable[[Path, Any, bool], ImageDataset]
    check: Callable[[Path, Any], None]
    num_classes: Callable[[Any], int]
    options: type[BaseModel] = NoOptions
    needs_root: bool = True


DATASETS: Registry[DatasetSpec] = Registry("dataset")


def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    return DATASETS.register(spec.name)(spec)


def resolve_root(spec: DatasetSpec, root: str | None) -> Path:
    """Config `data.root`, else `$PROMPTFCL_DATA/<folder>`, else `./data/<folder>`."""
    if root:
        return Path(root).expanduser()
    base = os.environ.get("PROMPTFCL_DATA")
    return Path(base).expanduser() / spec.folder if base else Path("data") / spec.folder


def subsample_per_class(split: ImageSplit, per_class: int | None, rng: np.random.Generator) -> ImageSplit:
    """Keep at most `per_class` images of every class, chosen with `rng`, in original order."""
    if per_class is None:
        return split
    targets = split.targets.numpy()
    keep = []
    for c in np.unique(targets):
        idx = np.flatnonzero(targets == c)
        if len(idx) > per_class:
            idx = np.sort(rng.choice(idx, size=per_class, replace=False))
        keep.append(idx)
    return split.subset(np.sort(np.concatenate(keep)))
