"""Benchmark of full-size file datasets: build the image cache, hit it, decode into RAM, read batches.

Generates an ImageNet-R-sized tree (`--images` JPEGs of `--px` pixels, 200 classes, an 80/20 '<path> <class id>'
split for the `image_folder` adapter) and, each in a fresh process through `promptfcl.runtime.load_dataset`:

1. **cold**: builds the cache (`data.cache: true`) with `--workers` decoding threads (one row per count);
2. **warm**: the same config again, a cache hit (lists, stats every file, maps the file);
3. **ram**: `data.cache: false`, everything decoded into RAM.

Each row reports wall seconds of `load_dataset`, images decoded per second, and the growth of the resident set
over the load (peak VmHWM after a reset minus VmRSS before; Linux). Then, in this process, random batches of 64
are gathered from the memory-mapped split and from the in-RAM one (images/s; the page cache is warm, so this is
the steady state of a training epoch, not a cold disk read). The load average is recorded before and after.

    python benchmarks/data_cache.py [--images 30000] [--px 64] [--size 64] [--workers 1 2] \\
        [--out benchmarks/results/data_cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

_MEASURE = """
import json, sys, time
from pathlib import Path

def status():
    rows = (line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(v.split()[0]) * 1024 for k, v in rows if k in ("VmRSS", "VmHWM")}

from promptfcl.config import build_config
from promptfcl.runtime import load_dataset

cfg = build_config(json.loads(sys.argv[1]))
Path("/proc/self/clear_refs").write_text("5")
before = status()["VmRSS"]
start = time.perf_counter()
ds = load_dataset(cfg)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "grew_mib": (status()["VmHWM"] - before) / 2**20,
                  "images": len(ds.train) + len(ds.test)}))
"""


def write_tree(root: Path, images: int, px: int) -> None:
    """`images` JPEGs (gradient + noise, so they compress like photos) in 200 class folders, 80/20 lists."""
    from PIL import Image

    rng = np.random.default_rng(0)
    classes = 200
    lines: dict[str, list[str]] = {"train": [], "test": []}
    ramp = np.linspace(0, 255, px, dtype=np.float32)
    for c in range(classes):
        (root / f"c{c:03d}").mkdir(parents=True)
        base = np.stack([ramp[None, :] * np.ones((px, 1)), ramp[:, None] * np.ones((1, px)), np.full((px, px), c)], -1)
        blobs = []
        for _ in range(4):  # a few distinct files per class, written many times (generation stays fast)
            img = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
            path = root / "tmp.jpg"
            Image.fromarray(img).save(path, quality=90)
            blobs.append(path.read_bytes())
        per_class = images // classes
        for k in range(per_class):
            rel = f"c{c:03d}/{k}.jpg"
            (root / rel).write_bytes(blobs[k % len(blobs)])
            lines["train" if k < 0.8 * per_class else "test"].append(f"{rel} {c}")
    (root / "tmp.jpg").unlink()
    for part, rows in lines.items():
        (root / f"{part}.txt").write_text("\n".join(rows) + "\n")


def measure(root: Path, cache_root: Path, size: int, **data: Any) -> dict[str, Any]:
    raw = {
        "data": {"name": "image_folder", "root": str(root), "options": {"decode_size": size, "num_classes": 200}},
        "scenario": {"num_tasks": 10},
    }
    raw["data"].update(data)
    env = {**os.environ, "PROMPTFCL_CACHE": str(cache_root), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(raw)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    m = json.loads(out.stdout.strip().splitlines()[-1])
    m["images_per_s"] = m["images"] / m["seconds"]
    return m


def gather_rate(images: Any, batches: int = 200, batch: int = 64) -> float:
    import torch

    gen = torch.Generator().manual_seed(0)
    idx = [torch.randint(0, images.shape[0], (batch,), generator=gen) for _ in range(batches)]
    images[idx[0]].sum()  # warm-up
    start = time.perf_counter()
    for i in idx:
        images[i].float()  # what LabeledSubset.batches does before the transform
    return batches * batch / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=30_000)
    ap.add_argument("--px", type=int, default=64, help="side of the generated JPEGs")
    ap.add_argument("--size", type=int, default=64, help="data.options.decode_size")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("needs Linux /proc (peak RSS reset)")
    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "loadavg_before": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tree"
        start = time.perf_counter()
        write_tree(root, args.images, args.px)
        result["tree_seconds"] = time.perf_counter() - start
        rows = {}
        for w in args.workers:
            rows[f"cold_workers{w}"] = measure(root, Path(tmp) / f"cache{w}", args.size, decode_workers=w)
        w = args.workers[-1]
        rows["warm"] = measure(root, Path(tmp) / f"cache{w}", args.size)
        rows["ram"] = measure(root, Path(tmp) / "unused", args.size, cache=False, decode_workers=w)
        result["loads"] = rows
        cache_file = max((Path(tmp) / f"cache{w}" / "images").glob("*-train-*.npy"), key=lambda p: p.stat().st_size)
        result["cache_file_bytes"] = cache_file.stat().st_size

        import torch

        mapped = torch.from_numpy(np.load(cache_file, mmap_mode="c"))
        in_ram = mapped.clone()
        result["gather_images_per_s"] = {"mapped": gather_rate(mapped), "ram": gather_rate(in_ram)}
    result["loadavg_after"] = os.getloadavg()
    print(f"tree of {args.images} JPEGs ({args.px} px) written in {result['tree_seconds']:.1f} s")
    print(f"{'load':<16}{'seconds':>9}{'images/s':>10}{'RSS growth MiB':>16}")
    for name, m in rows.items():
        print(f"{name:<16}{m['seconds']:>9.1f}{m['images_per_s']:>10.0f}{m['grew_mib']:>16.1f}")
    g = result["gather_images_per_s"]
    print(f"random batches of 64: mapped {g['mapped']:.0f} images/s, in RAM {g['ram']:.0f} images/s")
    print(f"load average before {result['loadavg_before']}, after {result['loadavg_after']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
