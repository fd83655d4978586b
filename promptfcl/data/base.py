"""Image splits (decoded uint8 tensors, or file lists not decoded yet), datasets, subsampling and the registry."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from promptfcl.registry import DATASETS


class DataMissingError(FileNotFoundError):
    """A dataset's files are not where the config says; the message names the folder and files expected."""


@dataclass
class ImageSplit:
    """One split: uint8 images (N, 3, H, W) and int64 class ids (N,).

    `images` is an ordinary tensor for the in-memory datasets (CIFAR, Fashion-MNIST, synthetic) and a tensor
    mapped copy-on-write from a cache file for file-based ones (`promptfcl.data.cache`): indexing a batch reads
    only that batch's pages, and every process mapping the file shares them.
    """

    images: torch.Tensor = field(repr=False)
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
class FileSplit:
    """A split listed by file and not decoded yet: images `base/<path>` with their class ids, to be decoded to
    `size` × `size` pixels.

    `subset` only selects list entries, so a subsample decodes nothing it drops; `promptfcl.data.cache.materialize`
    decodes the kept files once (into a memory-mapped cache file, or into RAM) and returns an `ImageSplit`.
    """

    base: Path
    paths: list[str] = field(repr=False)
    targets: torch.Tensor
    size: int

    def __post_init__(self) -> None:
        if self.targets.shape != (len(self.paths),):
            raise ValueError("targets must have one entry per listed file")
        self.targets = self.targets.long()

    def __len__(self) -> int:
        return len(self.paths)

    def subset(self, indices: np.ndarray | torch.Tensor) -> FileSplit:
        idx = np.asarray(indices, dtype=np.int64)
        return FileSplit(
            self.base, [self.paths[i] for i in idx], self.targets[torch.from_numpy(idx)].clone(), self.size
        )


Split = ImageSplit | FileSplit


@dataclass
class ImageDataset:
    """A dataset with train and test splits and class names.

    Adapters of file-based releases return `FileSplit`s; `promptfcl.runtime.load_dataset` subsamples them and
    decodes what is kept, so every dataset a run sees holds `ImageSplit`s.
    """

    name: str
    train: Split
    test: Split
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
    layout; `load(root, options, download)` returns an `ImageDataset` whose splits are decoded tensors
    (`ImageSplit`) or file lists (`FileSplit`, decoded by `load_dataset` after subsampling); `num_classes(options)`
    lets configs be validated without decoding. `own_long_tail`: the training split may carry its own long-tailed
    class counts (ImageNet-LT, image lists), so `scenario.long_tail.profile: dataset` is allowed on it.
    """

    name: str
    folder: str
    load: Callable[[Path, Any, bool], ImageDataset]
    check: Callable[[Path, Any], None]
    num_classes: Callable[[Any], int]
    options: type[BaseModel] = NoOptions
    needs_root: bool = True
    own_long_tail: bool = False




def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    return DATASETS.register(spec.name)(spec)


def resolve_root(spec: DatasetSpec, root: str | None) -> Path:
    """Config `data.root`, else `$PROMPTFCL_DATA/<folder>`, else `./data/<folder>`."""
    if root:
        return Path(root).expanduser()
    base = os.environ.get("PROMPTFCL_DATA")
    return Path(base).expanduser() / spec.folder if base else Path("data") / spec.folder


def subsample_per_class(split: Split, per_class: int | None, rng: np.random.Generator) -> Split:
    """Keep at most `per_class` images of every class, chosen with `rng`, in original order (a `FileSplit` stays
    a file list: nothing is decoded here)."""
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
