"""Fashion-MNIST (Xiao et al., 2017): 70,000 28×28 grayscale images of 10 clothing classes, official split.

Layout (`data.root`, default `$PROMPTFCL_DATA/fashion-mnist`): the four IDX files of the release
(http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/ or github.com/zalandoresearch/fashion-mnist),
gzipped or not, in `<root>/`, `<root>/raw/` or `<root>/FashionMNIST/raw/` (torchvision's layout):
`train-images-idx3-ubyte`, `train-labels-idx1-ubyte` (60,000), `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`
(10,000). Gray is repeated into three RGB channels; images stay 28 px (the transform resizes to the backbone).
CAPT builds Fashion-MNIST-LT from the train split by long-tail subsampling (scenario.kind: long_tailed).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from promptfcl.data.base import DataMissingError, DatasetSpec, ImageDataset, ImageSplit, NoOptions, register_dataset

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _find(root: Path, name: str) -> Path | None:
    for folder in (root, root / "raw", root / "FashionMNIST" / "raw"):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def check_fashion_mnist(root: Path, o: NoOptions) -> None:
    missing = [n for n in _FILES if _find(root, n) is None]
    if missing:
        raise DataMissingError(
            f"Fashion-MNIST not found in {root}/ (nor its raw/ or FashionMNIST/raw/): expected the IDX files "
            f"{', '.join(_FILES)} (each may end in .gz); missing: {', '.join(missing)}. Download them from "
            "github.com/zalandoresearch/fashion-mnist elsewhere and set data.root (or $PROMPTFCL_DATA to the parent "
            "of fashion-mnist/); nothing is downloaded."
        )


def read_idx(path: Path, dims: int) -> np.ndarray:
    """An IDX array of unsigned bytes (magic 0x0000 08 <dims>), optionally gzipped."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(data) < 4 + 4 * dims or data[:3] != b"\x00\x00\x08" or data[3] != dims:
        raise DataMissingError(f"{path} is not an IDX file of unsigned bytes with {dims} dimension(s)")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    body = data[4 + 4 * dims :]
    if len(body) != int(np.prod(shape)):
        raise DataMissingError(f"{path} holds {len(body)} bytes for shape {shape}: truncated or corrupt")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def _split(root: Path, prefix: str) -> ImageSplit:
    images = read_idx(_find(root, f"{prefix}-images-idx3-ubyte"), 3)  # type: ignore[arg-type]
    labels = read_idx(_find(root, f"{prefix}-labels-idx1-ubyte"), 1)  # type: ignore[arg-type]
    if len(images) != len(labels) or labels.max(initial=0) >= len(CLASSES):
        raise DataMissingError(
            f"Fashion-MNIST {prefix} images and labels do not match ({len(images)} vs {len(labels)})"
        )
    rgb = torch.from_numpy(images.copy()).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()
    return ImageSplit(rgb, torch.from_numpy(labels.astype(np.int64)))


def load_fashion_mnist(root: Path, o: NoOptions, download: bool) -> ImageDataset:
    check_fashion_mnist(root, o)
    return ImageDataset("fashion_mnist", _split(root, "train"), _split(root, "t10k"), list(CLASSES))


register_dataset(
    DatasetSpec("fashion_mnist", "fashion-mnist", load_fashion_mnist, check_fashion_mnist, lambda o: 10, NoOptions)
)
