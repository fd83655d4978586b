"""Shared mechanics of the file-based datasets: split lists, class folders, seeded splits, image decoding.

Every adapter (`image_folder`, ImageNet-R/-A/-LT, DomainNet, EuroSAT, Cars-196, CUB-200) reduces its layout to
*rows* — `(path relative to a base folder, class id)` — and hands them to `decode_rows`, which decodes each image
once, resizes it to a square and keeps uint8 tensors (threads for large lists: PIL releases the GIL).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from promptfcl.data.base import DataMissingError, ImageSplit
from promptfcl.seeding import numpy_rng

Row = tuple[str, int]
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
_PARALLEL_FROM = 256  # images; below this a thread pool costs more than it saves


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


def _decode_one(path: Path, size: int) -> np.ndarray:
    from PIL import Image

    if not path.is_file():
        raise DataMissingError(f"{path} is listed in the split file but does not exist")
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB").resize((size, size), Image.BICUBIC))
    except OSError as e:
        raise DataMissingError(f"{path} could not be decoded as an image: {e}") from None


def decode_rows(root: Path, rows: Sequence[Row], size: int) -> ImageSplit:
    """Decode `root/<path>` of every row into a uint8 (N, 3, size, size) split (bicubic resize, RGB)."""
    images = np.empty((len(rows), size, size, 3), dtype=np.uint8)
    paths = [root / rel for rel, _ in rows]
    if len(rows) >= _PARALLEL_FROM:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for i, img in enumerate(pool.map(lambda p: _decode_one(p, size), paths)):
                images[i] = img
    else:
        for i, p in enumerate(paths):
            images[i] = _decode_one(p, size)
    targets = torch.tensor([c for _, c in rows], dtype=torch.long)
    return ImageSplit(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), targets)
