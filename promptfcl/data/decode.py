"""Decoding image files into uint8 (3, S, S) arrays: one file, or a list of them with a pool of threads.

Every file-based dataset decodes the same way: Pillow opens the file, converts it to RGB and resizes it to a
square of `size` pixels (bicubic), as `decode_rows` did before the cache existed, so cached and uncached runs
see identical pixels. Pillow releases the GIL while it decodes and resizes, so threads decode in parallel without
moving pixels between processes; each thread holds one image at a time and hands it to a `write` callback that
stores it (into RAM or a file), so peak memory does not grow with the number of images.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from promptfcl.data.base import DataMissingError

RESAMPLE = "bicubic"  # part of the cache key: a different filter gives different pixels
_PARALLEL_FROM = 256  # images; below this a thread pool costs more than it saves
_CHUNK = 64  # images per pool task


def decode_image(path: Path, size: int) -> np.ndarray:
    """`path` as a uint8 (3, size, size) array: RGB, bicubic resize to a square."""
    from PIL import Image

    if not path.is_file():
        raise DataMissingError(f"{path} is listed in the split file but does not exist")
    try:
        with Image.open(path) as im:
            hwc = np.asarray(im.convert("RGB").resize((size, size), Image.BICUBIC))
    except OSError as e:
        raise DataMissingError(f"{path} could not be decoded as an image: {e}") from None
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


def default_workers() -> int:
    """Decoding threads when `data.decode_workers` is not set: the usable CPUs, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cpus))


def decode_all(
    paths: Sequence[Path], size: int, write: Callable[[int, np.ndarray], None], workers: int | None = None
) -> None:
    """Decode every file of `paths` and call `write(position, image)` once per image, from worker threads.

    `write` must store the image before returning (it is called concurrently for different positions). The first
    error (a missing or unreadable file) cancels the images not started yet and is raised.
    """
    workers = workers or default_workers()
    if workers == 1 or len(paths) < _PARALLEL_FROM:
        for i, p in enumerate(paths):
            write(i, decode_image(p, size))
        return

    def run(start: int) -> None:
        for i in range(start, min(start + _CHUNK, len(paths))):
            write(i, decode_image(paths[i], size))

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="promptfcl-decode")
    try:
        for _ in pool.map(run, range(0, len(paths), _CHUNK)):
            pass
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
