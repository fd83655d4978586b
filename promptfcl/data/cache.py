"""Decoded images of file-based datasets, built once per file list and size into a memory-mapped uint8 cache.

`materialize` turns a `FileSplit` (paths and class ids, already subsampled, so dropped images are never decoded)
into an `ImageSplit`:

- **cached** (default; `data.cache: true`): the images are decoded once into
  `<cache dir>/images/<dataset>-<split>-<S>px-<N>-<key>.npy`, an uncompressed `.npy` of uint8 (N, 3, S, S) —
  N·3·S² bytes on disk: ImageNet-R (30,000 images) 4.5 GB at 224 px, ImageNet-LT (165,846) 25.0 GB, all of
  DomainNet (586,575) 88.3 GB; a lower `data.options.decode_size` shrinks it quadratically. Decoding threads
  (`data.decode_workers`, `promptfcl.data.decode`) write each image straight into a temporary file with `pwrite`,
  one image per thread in memory at a time, so building takes a bounded amount of RAM whatever N is; the file is
  fsynced and renamed into place, so a finished name is always a complete file. Every later run, and every
  process of one (Flower nodes, study jobs), maps it copy-on-write: a batch reads only its own pages, the page
  cache shares them between processes, and the kernel can drop them under memory pressure.
- **in RAM** (`data.cache: false`): decoded into one N·3·S² array per run, with the same bounded overhead.

The key is a SHA-256 of the format version, the resampling filter, S, the absolute base folder and every listed
path with its file size and modification time, so a changed, added or removed image (or another subsample) gives
a new file; stale files are never reused, and never deleted either (delete `<cache dir>/images/` to reclaim the
space). Processes building the same key wait on a lock file (POSIX `flock`) and the second one maps the first
one's result. The cache directory is `data.cache_dir`, else `$PROMPTFCL_CACHE`, else `$XDG_CACHE_HOME/promptfcl`
(`~/.cache/promptfcl`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from promptfcl.data.base import DataMissingError, FileSplit, ImageSplit, Split
from promptfcl.data.decode import RESAMPLE, decode_all

FORMAT = 1
_log = logging.getLogger(__name__)


class CacheError(OSError):
    """The image cache cannot be written where configured; the message says how to fix it."""


def default_cache_dir() -> Path:
    """`$PROMPTFCL_CACHE`, else `$XDG_CACHE_HOME/promptfcl`, else `~/.cache/promptfcl`."""
    env = os.environ.get("PROMPTFCL_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "promptfcl"


def materialize(
    split: Split, dataset: str, role: str, cache_dir: Path | None, workers: int | None = None
) -> ImageSplit:
    """`split` decoded: an `ImageSplit` as is; a `FileSplit` mapped from its cache file under `cache_dir`
    (built on first use), or decoded into RAM when `cache_dir` is None."""
    if isinstance(split, ImageSplit):
        return split
    if cache_dir is None:
        return decode_in_memory(split, workers)
    path = cache_file(split, Path(cache_dir) / "images", dataset, role)
    return ImageSplit(_open_or_build(split, path, workers), split.targets)


def decode_in_memory(split: FileSplit, workers: int | None = None) -> ImageSplit:
    """Every listed image decoded into one uint8 (N, 3, S, S) tensor in RAM."""
    out = np.empty((len(split), 3, split.size, split.size), dtype=np.uint8)

    def write(i: int, image: np.ndarray) -> None:
        out[i] = image

    decode_all([split.base / p for p in split.paths], split.size, write, workers)
    return ImageSplit(torch.from_numpy(out), split.targets)


def cache_file(split: FileSplit, folder: Path, dataset: str, role: str) -> Path:
    """Where `split`'s cache file lives; stats every listed file (a missing one is reported here)."""
    h = hashlib.sha256()
    head = {"format": FORMAT, "resample": RESAMPLE, "size": split.size, "base": str(split.base.resolve())}
    h.update(json.dumps(head, sort_keys=True).encode())
    for rel in split.paths:
        try:
            st = os.stat(split.base / rel)
        except OSError:
            raise DataMissingError(f"{split.base / rel} is listed in the split file but does not exist") from None
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return folder / f"{dataset}-{role}-{split.size}px-{len(split)}-{h.hexdigest()[:24]}.npy"


def _open(path: Path, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The cache file mapped copy-on-write, or None if it is absent or not a uint8 array of `shape`."""
    try:
        arr = np.load(path, mmap_mode="c")
    except (OSError, ValueError):
        return None
    if arr.dtype != np.uint8 or arr.shape != shape:
        return None
    return torch.from_numpy(arr)


def _open_or_build(split: FileSplit, path: Path, workers: int | None) -> torch.Tensor:
    shape = (len(split), 3, split.size, split.size)
    images = _open(path, shape)
    if images is not None:
        return images
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(
            f"cannot create the image cache folder {path.parent} ({e}); set data.cache_dir (or $PROMPTFCL_CACHE) to "
            "a writable folder, or data.cache: false to decode into RAM at every run"
        ) from None
    with _lock(path):
        images = _open(path, shape)  # another process may have built it while we waited
        if images is None:
            _build(split, path, workers)
            images = _open(path, shape)
    if images is None:
        raise CacheError(f"{path} could not be read back after building it; delete it and run again")
    return images


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): concurrent builders both build; the rename keeps the file whole
        yield
        return
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(split: FileSplit, path: Path, workers: int | None) -> None:
    """Decode `split` into a temporary .npy next to `path` with positioned writes, fsync it, rename it."""
    n, s = len(split), split.size
    per_image = 3 * s * s
    nbytes = n * per_image
    for stale in path.parent.glob(f"{path.name}.*.tmp"):  # left by a killed builder (we hold the lock)
        stale.unlink(missing_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < nbytes + (64 << 20):
        raise CacheError(
            f"the image cache needs {_size(nbytes)} for {n} images at {s} px but {path.parent} has "
            f"{_size(free)} free; set data.cache_dir (or $PROMPTFCL_CACHE) to a larger disk, or lower "
            "data.options.decode_size (the size is N·3·S² bytes)"
        )
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp", delete=False) as f:
        tmp = Path(f.name)
    try:
        with open(tmp, "wb") as f:
            np.lib.format.write_array_header_1_0(
                f,
                {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                    "fortran_order": False,
                    "shape": (n, 3, s, s),
                },
            )
            offset = f.tell()
            f.truncate(offset + nbytes)
            f.flush()
            fd = f.fileno()

            def write(i: int, image: np.ndarray) -> None:
                if os.pwrite(fd, image.data, offset + i * per_image) != per_image:
                    raise CacheError(f"short write to {tmp} (disk full?)")

            decode_all([split.base / p for p in split.paths], s, write, workers)
            os.fsync(fd)
        meta = {"format": FORMAT, "base": str(split.base), "images": n, "size": s, "bytes": nbytes}
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _log.info("decoded %d images (%s) into %s in %.1f s", n, _size(nbytes), path, time.perf_counter() - start)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**8 else f"{nbytes / 1e6:.3g} MB"
