"""Shared mechanics of the file-based datasets: split lists, class folders, seeded splits.

Every adapter (`image_folder`, ImageNet-R/-A/-LT, DomainNet, EuroSAT, Cars-196, CUB-200) reduces its layout to
*rows* — `(path relative to a base folder, class id)` — and hands them to `file_split`, which keeps the list
without decoding anything: `promptfcl.runtime.load_dataset` subsamples it, then `promptfcl.data.cache` decodes
the kept images once (`promptfcl.data.decode`) into a memory-mapped cache file.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from promptfcl.data.base import DataMissingError, FileSplit
from promptfcl.seeding import numpy_rng

Row = tuple[str, int]
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})


def read_list(path: Path) -> list[Row]:
    """Rows of a split file with one '<relative path> <class id>' per line (blank lines ignored)."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise DataMissingError(f"{path}:{n}: expected '<relative path> <class id>', got {line!r}")
        rows.append((parts[0], int(parts[1])))
    if not rows:
        raise DataMissingError(f"{path} lists no images")
    return rows


def scan_class_folders(folder: Path) -> tuple[list[Row], list[str]]:
    """`folder/<class>/<image>` → rows and class names, classes in sorted folder-name order (torchvision
    `ImageFolder`'s convention), images sorted by name within each class."""
    if not folder.is_dir():
        raise DataMissingError(f"{folder}/ does not exist: expected one sub-folder of images per class")
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    rows = [
        (f"{name}/{f.name}", c)
        for c, name in enumerate(classes)
        for f in sorted((folder / name).iterdir())
        if f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not rows:
        raise DataMissingError(f"{folder}/ holds no images in class sub-folders (<class>/<image>.jpg)")
    return rows, classes


def pooled_split(rows: Sequence[Row], train_fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """HePCo's split (official code, `dataloaders/dataloader.py`): python `random.seed(seed)` shuffles the indices
    of all pooled images; the first ⌊fraction·n⌋ are train, the rest test. Not stratified by class.

    Python's `random` (not promptfcl.seeding) on purpose: it reproduces the official draw for a given row order.
    """
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    cut = int(train_fraction * len(rows))
    return [rows[i] for i in order[:cut]], [rows[i] for i in order[cut:]]


def per_class_split(rows: Sequence[Row], train_fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """Stratified split: in every class a seeded permutation puts round(fraction·n_c) images in train (at least
    one image on each side when the class has two or more), the rest in test; rows keep their input order."""
    targets = np.array([c for _, c in rows])
    is_train = np.zeros(len(rows), dtype=bool)
    rng = numpy_rng(seed, "per_class_split")
    for c in np.unique(targets):
        idx = np.flatnonzero(targets == c)
        k = int(round(train_fraction * len(idx)))
        if len(idx) >= 2:
            k = min(max(k, 1), len(idx) - 1)
        is_train[rng.permutation(idx)[:k]] = True
    return [r for r, t in zip(rows, is_train, strict=True) if t], [
        r for r, t in zip(rows, is_train, strict=True) if not t
    ]


def names_from_rows(rows: Sequence[Row], num_classes: int, level: int = 1, what: str = "class") -> list[str]:
    """Class names read off the paths: the folder `level` steps above each image, one name per class id.

    A class id whose images sit in different folders means the split file and the tree disagree: refused.
    """
    names: dict[int, str] = {}
    for rel, c in rows:
        parts = Path(rel).parts
        name = parts[-1 - level] if len(parts) > level else f"{what}_{c}"
        if names.setdefault(c, name) != name:
            raise DataMissingError(
                f"class id {c} is listed for images in folder {names[c]!r} and in {name!r}: the split file does "
                "not match the image tree (use the split files that belong to this release)"
            )
    return [names.get(c, f"{what}_{c}") for c in range(num_classes)]


def check_files(base: Path, names: Sequence[str], what: str, how: str) -> None:
    """Raise `DataMissingError` naming every missing file/folder (a trailing '/' marks a folder) under `base`."""
    missing = [n for n in names if not ((base / n).is_dir() if n.endswith("/") else (base / n).is_file())]
    if missing:
        raise DataMissingError(
            f"{what} not found in {base}/: expected {', '.join(names)} there (missing: {', '.join(missing)}). "
            f"{how} Set data.root to that folder (or $PROMPTFCL_DATA to its parent); nothing is downloaded."
        )


def check_subfolders(base: Path, label: str, what: str, how: str) -> None:
    """Raise `DataMissingError` unless `base` holds at least one (class / domain) sub-folder, named `label`."""
    if not base.is_dir() or not any(d.is_dir() for d in base.iterdir()):
        check_files(base, [label], what, how)


def file_split(root: Path, rows: Sequence[Row], size: int) -> FileSplit:
    """The images `root/<path>` of `rows`, listed (not decoded) for decoding to `size` × `size` pixels."""
    return FileSplit(root, [rel for rel, _ in rows], torch.tensor([c for _, c in rows], dtype=torch.long), size)
