"""CIFAR-10 / CIFAR-100 from the original python release, read without trusting pickle.

The release is a pickle of dicts of numpy arrays. We never call `pickle.load` on it: a restricted
unpickler accepts only the handful of numpy/builtin constructors the release uses, so a tampered file
cannot execute code. The official md5 sums are checked too, and a mismatch is refused unless
`data.options.verify_md5: false`.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from promptfcl.data.base import DataMissingError, DatasetSpec, ImageDataset, ImageSplit, register_dataset

_MD5 = {
    "cifar-100-python": {
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
        "meta": "7973b15100ade9c7d40fb424638fde48",
    },
    "cifar-10-batches-py": {
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
        "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
    },
}
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR file")


def _read_release_file(path: Path, verify_md5: bool, expected: str | None) -> dict[str, Any]:
    data = path.read_bytes()
    if verify_md5 and expected is not None:
        got = hashlib.md5(data).hexdigest()
        if got != expected:
            raise DataMissingError(
                f"{path} has md5 {got}, not the official {expected}: the file is corrupt or not the official "
                "release. Replace it, or set data.options.verify_md5: false to read it anyway."
            )
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except pickle.UnpicklingError as e:  # a refused global (tampered file) or a broken stream
        raise UnreadableReleaseError(
            f"{path} is not a readable CIFAR python-release file ({e}); it is truncated, corrupt or tampered with "
            "— download and unpack the official release again"
        ) from None
    except Exception as e:  # noqa: BLE001 - truncated or garbled files fail in many ways inside pickle
        raise DataMissingError(
            f"{path} is not a readable CIFAR python-release file ({type(e).__name__}: {e}); it is truncated or "
            "corrupt — download and unpack the release again"
        ) from None
    if not isinstance(obj, dict):
        raise DataMissingError(f"{path} does not hold a CIFAR release dictionary; replace it with the official file")
    return obj


class UnreadableReleaseError(DataMissingError, pickle.UnpicklingError):
    """A release file the restricted unpickler refused (it asks for code the release never contains)."""


class CifarOptions(BaseModel):
    """Options for the CIFAR loaders."""

    model_config = ConfigDict(extra="forbid")
    verify_md5: bool = True


def _find_folder(root: Path, folder: str) -> Path:
    return root if root.name == folder or (root / _first_file(folder)).is_file() else root / folder


def _first_file(folder: str) -> str:
    return next(iter(_MD5[folder]))


def _check(folder: str, what: str) -> Any:
    def check(root: Path, options: CifarOptions) -> None:
        base = _find_folder(root, folder)
        missing = [f for f in _MD5[folder] if not (base / f).is_file()]
        if missing:
            raise DataMissingError(
                f"{what} not found: expected the python release in {base}/ with files "
                f"{', '.join(_MD5[folder])} (missing: {', '.join(missing)}). Download "
                f"https://www.cs.toronto.edu/~kriz/{folder.replace('-batches-py', '').replace('-python', '')}"
                f"-python.tar.gz elsewhere, unpack it so that {base} exists, and set data.root or "
                f"$PROMPTFCL_DATA; or set data.download: true on a machine with internet."
            )

    return check


def _fields(path: Path, d: dict[str, Any], *keys: str) -> dict[str, Any]:
    missing = [k for k in keys if k not in d]
    if missing:
        raise DataMissingError(f"{path} lacks {', '.join(missing)}: not a CIFAR release file; replace it")
    return d


def _to_images(flat: np.ndarray) -> torch.Tensor:
    if not isinstance(flat, np.ndarray) or flat.size % (3 * 32 * 32):
        raise DataMissingError("a CIFAR file's image array is not N × 3072 bytes: the file is corrupt; replace it")
    return torch.from_numpy(np.ascontiguousarray(flat.reshape(-1, 3, 32, 32).astype(np.uint8)))


def _maybe_download(root: Path, folder: str, download: bool) -> None:
    if download and not (_find_folder(root, folder) / _first_file(folder)).is_file():
        import torchvision

        cls = torchvision.datasets.CIFAR100 if folder == "cifar-100-python" else torchvision.datasets.CIFAR10
        cls(root=str(root), download=True)


def load_cifar100(root: Path, options: CifarOptions, download: bool) -> ImageDataset:
    _maybe_download(root, "cifar-100-python", download)
    _check("cifar-100-python", "CIFAR-100")(root, options)
    base, md5 = _find_folder(root, "cifar-100-python"), _MD5["cifar-100-python"]
    splits = {}
    for split in ("train", "test"):
        d = _fields(
            base / split, _read_release_file(base / split, options.verify_md5, md5[split]), "data", "fine_labels"
        )
        splits[split] = ImageSplit(_to_images(d["data"]), torch.tensor(d["fine_labels"]))
    meta = _fields(
        base / "meta", _read_release_file(base / "meta", options.verify_md5, md5["meta"]), "fine_label_names"
    )
    return ImageDataset("cifar100", splits["train"], splits["test"], list(meta["fine_label_names"]))


def load_cifar10(root: Path, options: CifarOptions, download: bool) -> ImageDataset:
    _maybe_download(root, "cifar-10-batches-py", download)
    _check("cifar-10-batches-py", "CIFAR-10")(root, options)
    base, md5 = _find_folder(root, "cifar-10-batches-py"), _MD5["cifar-10-batches-py"]
    parts = [
        _read_release_file(base / f"data_batch_{i}", options.verify_md5, md5[f"data_batch_{i}"]) for i in range(1, 6)
    ]
    train = ImageSplit(
        _to_images(np.concatenate([p["data"] for p in parts])),
        torch.tensor(np.concatenate([p["labels"] for p in parts])),
    )
    t = _read_release_file(base / "test_batch", options.verify_md5, md5["test_batch"])
    meta = _read_release_file(base / "batches.meta", options.verify_md5, md5["batches.meta"])
    return ImageDataset(
        "cifar10", train, ImageSplit(_to_images(t["data"]), torch.tensor(t["labels"])), list(meta["label_names"])
    )


register_dataset(
    DatasetSpec(
        "cifar100",
        "cifar-100-python",
        load_cifar100,
        _check("cifar-100-python", "CIFAR-100"),
        lambda o: 100,
        CifarOptions,
    )
)
register_dataset(
    DatasetSpec(
        "cifar10",
        "cifar-10-batches-py",
        load_cifar10,
        _check("cifar-10-batches-py", "CIFAR-10"),
        lambda o: 10,
        CifarOptions,
    )
)
