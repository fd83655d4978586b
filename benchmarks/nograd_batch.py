"""Which batch size makes a no-grad pass fastest on the CPU: images/s of the hybrid backbone's forward per batch size.

Every no-grad pass over client or test data (evaluation, class statistics, LoRM's Grams, the prompt-effect pass,
C2Prompt's and Powder's feature passes) is a forward of the frozen backbone in batches, so its speed is the
backbone's throughput at that batch size. This script times `FrozenViT.forward` (the transform included) on
synthetic 112 px images for each batch size, without prompts and with a prefix prompt (length 20 in layers 0-4,
the HGP / FedAvg-Prompt CPU presets), at 1 and 2 torch threads, and prints one table of images/s per batch size.

The hybrid's stem is cached per image (`backbone.stem_cache`, computed one image at a time so it does not depend on
the batch), so the batch size moves only the ViT part: the stem cache is filled before timing, as it is in a run
after an image's first pass. Each cell is the median of `--repeats` timed passes over `--images` images; every cell
takes its turn within each repeat (after a warm-up round), so a change of the machine's load falls on all cells
alike. Two tables: wall-clock images/s, and images per process-CPU second (`time.process_time()`, all threads), which
other processes sharing the cores disturb far less; the load average is recorded before, after and per repeat.

    python benchmarks/nograd_batch.py --out benchmarks/results/nograd_batch.json

Uses the distilled weights when `PROMPTFCL_ASSETS` (or ../shared/assets) holds them, else a random-init hybrid (the
timing does not depend on the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from promptfcl.backbones import build_vit
from promptfcl.backbones.hybrid import HYBRID_WEIGHTS
from promptfcl.config import BackboneConfig
from promptfcl.data.transforms import ImageTransform
from promptfcl.prompts.prefix import PrefixPrompt

BATCHES = (1, 4, 8, 16, 32, 64, 128, 256)


def cpu_name() -> str:
    """The CPU model (Linux: /proc/cpuinfo), else the platform's machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def weights() -> Path | None:
    for root in (os.environ.get("PROMPTFCL_ASSETS"), Path(__file__).resolve().parents[2] / "shared" / "assets"):
        if root and (Path(root) / "models" / HYBRID_WEIGHTS).is_file():
            return Path(root) / "models" / HYBRID_WEIGHTS
    return None


@torch.no_grad()
def one_pass(bb: Any, x: torch.Tensor, batch: int, prompt: PrefixPrompt | None) -> tuple[float, float]:
    """(wall images/s, images per process-CPU second) of one pass over `x` in batches of `batch`."""
    tf = ImageTransform(112)
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, len(x), batch):
        xb = tf(x[s : s + batch])
        bb(xb, None if prompt is None else prompt(len(xb)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return len(x) / wall, len(x) / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    w = weights()
    bb = build_vit(BackboneConfig(name="vit_tiny_hybrid_lite0", img_size=112, weights=str(w) if w else None))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (a.images, 3, 112, 112), generator=g, dtype=torch.uint8)
    torch.manual_seed(0)
    prompt = PrefixPrompt(bb.embed_dim, [0, 1, 2, 3, 4], 20, "uniform").requires_grad_(False)
    with torch.no_grad():  # fill the stem cache (one image at a time, as in a run)
        bb(ImageTransform(112)(x))
    cells = [
        (f"{name}, {t} thread{'s' if t > 1 else ''}", t, pr)
        for t in a.threads
        for name, pr in (("no prompt", None), ("prefix 20 x 5 layers", prompt))
    ]
    wall: dict[str, dict[int, list[float]]] = {c: {b: [] for b in a.batches} for c, _, _ in cells}
    cpu: dict[str, dict[int, list[float]]] = {c: {b: [] for b in a.batches} for c, _, _ in cells}
    load_before = os.getloadavg()
    loads = []
    for r in range(a.repeats + 1):  # every cell takes its turn in every repeat: load changes fall on all alike
        for col, threads, pr in cells:
            torch.set_num_threads(threads)
            for b in a.batches:
                rate, per_cpu = one_pass(bb, x, b, pr)
                if r:  # repeat 0 warms up
                    wall[col][b].append(rate)
                    cpu[col][b].append(per_cpu)
        loads.append(os.getloadavg()[0])
        print(f"repeat {r} done, load {loads[-1]:.2f}", flush=True)
    load_after = os.getloadavg()
    med = {k: {c: {str(b): statistics.median(v) for b, v in t.items()} for c, t in d.items()}
           for k, d in (("wall", wall), ("cpu", cpu))}  # fmt: skip
    cols = [c for c, _, _ in cells]
    best = {k: {c: int(max(med[k][c], key=lambda b: med[k][c][b])) for c in cols} for k in med}
    print(
        f"\nmedian of {a.repeats} passes over {a.images} synthetic 112 px images, stem cache warm; load average "
        f"before {tuple(round(v, 2) for v in load_before)}, after {tuple(round(v, 2) for v in load_after)}"
    )
    for k, what in (("wall", "wall-clock images/s"), ("cpu", "images per process-CPU second")):
        print(f"\n{what}")
        print(f"{'batch':>6} " + " ".join(f"{c:>29}" for c in cols))
        for b in a.batches:
            print(f"{b:>6} " + " ".join(f"{med[k][c][str(b)]:29.1f}" for c in cols))
        print(f"{'best':>6} " + " ".join(f"{best[k][c]:29d}" for c in cols))
    result = {
        "what": "FrozenViT forward (transform included) per batch size, stem cache warm; median over repeats",
        "backbone": "vit_tiny_hybrid_lite0 112 px, " + ("distilled weights" if w else "random init"),
        "images": a.images,
        "repeats": a.repeats,
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "load_average_1min_per_repeat": loads,
        "wall_images_per_second": med["wall"],
        "images_per_cpu_second": med["cpu"],
        "fastest_batch": best,
        "samples": {
            "wall": {c: {str(b): v for b, v in t.items()} for c, t in wall.items()},
            "cpu": {c: {str(b): v for b, v in t.items()} for c, t in cpu.items()},
        },  # fmt: skip
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
