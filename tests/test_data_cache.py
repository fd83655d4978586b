"""File-based datasets at full size: subsampled before decoding, decoded once into a memory-mapped cache.

The large-tree test builds an ImageNet-R-sized tree (30,000 files in CODA-P's layout) through the real adapter
and measures the peak resident memory of `load_dataset` in a fresh process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from promptfcl.config import ConfigError, build_config
from promptfcl.data import decode, subsample_per_class
from promptfcl.runtime import Runtime, load_dataset
from promptfcl.seeding import numpy_rng

from .conftest import tiny_raw
from .test_datasets import _ids, _imagenet_r, _write_image

WNIDS = [f"n{10_000_000 + 7 * c:08d}" for c in range(200)]
TRAIN_PER_CLASS, TEST_PER_CLASS = 120, 30  # 24,000 / 6,000 images: CODA-P's ImageNet-R split sizes
LARGE_SIZE = 64  # decode size: the whole train split in RAM would be 24,000 x 3 x 64 x 64 B = 295 MB
PEAK_BOUND = 64 * 2**20  # bytes above the resident set before loading


def _png(color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def write_large_imagenet_r(root: Path) -> Path:
    """30,000 8x8 PNGs as <root>/<wnid>/<image>.png with CODA-P's YAML split files (paths as on their machine)."""
    docs = {"train": {"data": [], "targets": []}, "test": {"data": [], "targets": []}}
    for c, wnid in enumerate(WNIDS):
        (root / wnid).mkdir(parents=True)
        blob = _png((c, 255 - c, 7 * c % 256))
        for k in range(TRAIN_PER_CLASS + TEST_PER_CLASS):
            (root / wnid / f"art_{k}.png").write_bytes(blob)
            part = "train" if k < TRAIN_PER_CLASS else "test"
            docs[part]["data"].append(f"data/imagenet-r/{part}/{wnid}/art_{k}.png")
            docs[part]["targets"].append(c)
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    for part, doc in docs.items():
        (root / f"imagenet-r_{part}.yaml").write_text(yaml.dump(doc, Dumper=dumper))
    return root


@pytest.fixture(scope="module")
def large_imagenet_r(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_large_imagenet_r(tmp_path_factory.mktemp("large") / "imagenet-r")


_MEASURE = """
import json, sys
from pathlib import Path

def status():
    rows = (line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(v.split()[0]) * 1024 for k, v in rows if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}

from promptfcl.config import build_config
from promptfcl.runtime import load_dataset

cfg = build_config(json.loads(sys.argv[1]))
Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current resident set
before = status()["VmRSS"]
ds = load_dataset(cfg)
after = status()
ends = [0, len(ds.train) - 1]
out = {"before": before, "peak": after["VmHWM"], "after": after["VmRSS"], "anon": after["RssAnon"]}
out.update(train=list(ds.train.images.shape), test=list(ds.test.images.shape))
out.update(pixels=ds.train.images[ends][:, :, 0, 0].tolist(), targets=ds.train.targets[ends].tolist())
print(json.dumps(out))
"""


def _measure(root: Path, cache_root: Path, **data: object) -> dict:
    raw = tiny_raw()
    raw["data"] = {"name": "imagenet_r", "root": str(root), "options": {"decode_size": LARGE_SIZE}, **data}
    env = {"PROMPTFCL_CACHE": str(cache_root), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(raw)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak-RSS reset needs Linux /proc")
def test_large_tree_builds_with_bounded_peak_memory(large_imagenet_r: Path, tmp_path: Path) -> None:
    whole = TRAIN_PER_CLASS * len(WNIDS) * 3 * LARGE_SIZE**2
    assert whole > 3 * PEAK_BOUND  # decoding the split into RAM would break the bound by far
    m = _measure(large_imagenet_r, tmp_path / "cache")
    assert m["train"] == [24_000, 3, LARGE_SIZE, LARGE_SIZE] and m["test"] == [6_000, 3, LARGE_SIZE, LARGE_SIZE]
    assert m["pixels"] == [[0, 255, 0], [199, 56, 7 * 199 % 256]] and m["targets"] == [0, 199]
    grew = m["peak"] - m["before"]
    assert grew < PEAK_BOUND, f"loading grew the resident set by {grew / 2**20:.0f} MiB (bound {PEAK_BOUND >> 20})"


_DECODE_IMAGE = decode.decode_image


def _cfg(root: Path, **data: object):
    raw = tiny_raw()
    raw["data"] = {"name": "imagenet_r", "root": str(root), "options": {"split": "hepco", "decode_size": 4}, **data}
    return build_config(raw)


def _record_decodes(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[Path]:
    """Every path handed to the decoder (the only place pixels are decoded); `fail`: decoding raises."""
    seen: list[Path] = []
    real = _DECODE_IMAGE

    def spy(path: Path, size: int):
        if fail:
            raise AssertionError(f"{path} was decoded again")
        seen.append(path)
        return real(path, size)

    monkeypatch.setattr(decode, "decode_image", spy)
    return seen


@pytest.mark.parametrize("cache", [True, False])
def test_subsampling_decodes_only_the_images_it_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: bool
) -> None:
    root, ident = _imagenet_r(tmp_path)  # 3 classes x 5 images, HePCo's pooled split: 12 train / 3 test
    seen = _record_decodes(monkeypatch)
    ds = load_dataset(_cfg(root, train_per_class=2, test_per_class=1, cache=cache, cache_dir=str(tmp_path / "c")))
    kept, decoded = sorted(_ids(ds.train) + _ids(ds.test)), sorted(ident[str(p.relative_to(root))] for p in seen)
    assert len(ds.train) == 6 and decoded == kept, f"decoded {len(decoded)} images to keep {len(kept)}"
    # the same images the per-class subsample of the fully decoded split keeps (old runs stay reproducible)
    full = load_dataset(_cfg(root, cache=False))
    assert _ids(subsample_per_class(full.train, 2, numpy_rng(0, "subsample"))) == _ids(ds.train)


def _mapped_files() -> str:
    return Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""


def test_cache_is_built_once_mapped_and_rebuilt_when_a_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, ident = _imagenet_r(tmp_path)
    cfg = _cfg(root, cache_dir=str(tmp_path / "c"))
    in_ram = load_dataset(_cfg(root, cache=False))
    seen = _record_decodes(monkeypatch)
    ds = load_dataset(cfg)
    assert len(seen) == 15 and torch.equal(ds.train.images, in_ram.train.images)
    files = sorted((tmp_path / "c" / "images").glob("*.npy"))
    assert [f.name.split("-")[:4] for f in files] == [
        ["imagenet_r", "test", "4px", "3"],
        ["imagenet_r", "train", "4px", "12"],
    ]
    assert files[1].stat().st_size - 12 * 3 * 4 * 4 in (64, 128)  # the .npy header, then the raw pixels
    if _mapped_files():
        assert str(files[1]) in _mapped_files()  # the tensor is mapped from the file, not read into RAM

    _record_decodes(monkeypatch, fail=True)
    again = load_dataset(cfg)  # a hit: nothing is decoded
    assert torch.equal(again.train.images, in_ram.train.images) and torch.equal(again.test.images, in_ram.test.images)

    changed = next(r for r in sorted(ident) if ident[r] in _ids(ds.train))
    before = (root / changed).stat().st_mtime_ns
    _write_image(root / changed, 100)  # new pixels under the same name
    os.utime(root / changed, ns=(before + 10**9, before + 10**9))  # a newer mtime even on coarse-grained file systems
    seen = _record_decodes(monkeypatch)
    rebuilt = load_dataset(cfg)
    assert len(seen) == 12 and sorted(_ids(rebuilt.train)) == sorted(
        100 if i == ident[changed] else i for i in _ids(ds.train)
    )


def test_concurrent_builders_decode_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = _imagenet_r(tmp_path)
    seen = _record_decodes(monkeypatch)
    spy = decode.decode_image
    monkeypatch.setattr(decode, "decode_image", lambda p, s: (time.sleep(0.02), spy(p, s))[1])
    cfg, barrier, results = _cfg(root, cache_dir=str(tmp_path / "c")), threading.Barrier(2), []

    def run() -> None:
        barrier.wait()
        try:
            results.append(load_dataset(cfg))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [r for r in results if isinstance(r, Exception)], results
    assert len(seen) == 15  # the second builder waited on the lock and mapped the first one's file
    assert torch.equal(results[0].train.images, results[1].train.images)


def test_cache_problems_are_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from promptfcl.data import cache

    root, _ = _imagenet_r(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"cannot create the image cache folder .*set data.cache_dir"):
        Runtime.build(_cfg(root, cache_dir=str(tmp_path / "file")))
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(ConfigError, match=r"needs 0.000576 MB for 12 images at 4 px .*lower data.options.decode_size"):
        Runtime.build(_cfg(root, cache_dir=str(tmp_path / "c")))
