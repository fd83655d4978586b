"""The hybrid backbone's stem cache and stem memory layout: client-step and evaluation throughput, in one run.

The hybrid CPU backbone (`vit_tiny_hybrid_lite0`) puts a frozen EfficientNet-Lite0 stem before every prompt, so
its output is cached per image (and flip). This script trains a prefix prompt + head (the HGP / FedAvg-Prompt client
step: length 20 in layers 0–4, batch 16, Adam, flip augmentation) for a few epochs on real CIFAR-100 images and
times each epoch with the cache off, and with it on (epoch 1 fills it, later epochs hit it); then a forward-only
evaluation pass. Prints a table of images/s and the cached / uncached ratios. A second table times the stem's
memory layout (`backbone.stem_channels_last`) where the stem runs every time: training on random crops (`rrc_flip`,
the cache paused) and an uncached evaluation forward, channels-last against the default layout. Writes JSON.

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/stem_cache.py --out benchmarks/results/stem_cache.json

Take it on a quiet machine: the load average is recorded beside the numbers. Without the assets it falls back to
a random-init hybrid and random images (the ratios still hold: the stem's cost does not depend on its weights).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from promptfcl.backbones import build_vit
from promptfcl.config import BackboneConfig
from promptfcl.data.transforms import ImageTransform
from promptfcl.model import PromptedClassifier
from promptfcl.prompts.prefix import PrefixPrompt


def images(n: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    root = Path(os.environ.get("PROMPTFCL_ASSETS", "")) / "cifar-100-python"
    if (root / "train").is_file():
        from promptfcl.data.cifar import CifarOptions, load_cifar100

        split = load_cifar100(root, CifarOptions(), False).train
        return split.images[:n], split.targets[:n] % 10, "CIFAR-100 (first images)"
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8), torch.arange(n) % 10, "random"


def backbone(cache: bool, channels_last: bool = True) -> tuple[torch.nn.Module, str]:
    w = Path(os.environ.get("PROMPTFCL_ASSETS", "")) / "models" / "vit_tiny_hybrid_lite0_112_distilled.safetensors"
    cfg = BackboneConfig(name="vit_tiny_hybrid_lite0", img_size=112, stem_cache=cache,
                         stem_channels_last=channels_last, weights=str(w) if w.is_file() else None)  # fmt: skip
    return build_vit(cfg), "distilled weights" if w.is_file() else "random init"


def train_epochs(
    cache: bool, x: torch.Tensor, y: torch.Tensor, epochs: int, batch: int, augment: str = "flip",
    channels_last: bool = True,
) -> list[float]:  # fmt: skip
    bb, _ = backbone(cache, channels_last)
    torch.manual_seed(0)
    model = PromptedClassifier(bb, 10, PrefixPrompt(192, [0, 1, 2, 3, 4], 20, "uniform"))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tf = ImageTransform(112, augment=augment)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    rates = []
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        t0 = time.perf_counter()
        for s in range(0, len(x), batch):
            idx = order[s : s + batch]
            loss = torch.nn.functional.cross_entropy(model(tf(x[idx], gen)), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        rates.append(len(x) / (time.perf_counter() - t0))
    return rates


@torch.no_grad()
def eval_passes(cache: bool, x: torch.Tensor, passes: int, channels_last: bool = True) -> list[float]:
    bb, _ = backbone(cache, channels_last)
    tf = ImageTransform(112)
    rates = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for s in range(0, len(x), 128):
            bb(tf(x[s : s + 128]))
        rates.append(len(x) / (time.perf_counter() - t0))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=4, help="training epochs per setting (the first fills the cache)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    x, y, data = images(a.images)
    load_before = os.getloadavg()
    off = train_epochs(False, x, y, a.epochs, 16)
    on = train_epochs(True, x, y, a.epochs, 16)
    ev_off, ev_on = eval_passes(False, x, 2), eval_passes(True, x, 2)
    warm_off, warm_on = sum(off[1:]) / (a.epochs - 1), sum(on[1:]) / (a.epochs - 1)
    rows = [
        ("client step, first epoch (fills the cache)", off[0], on[0]),
        ("client step, later epochs (cache warm)", warm_off, warm_on),
        ("evaluation forward, second pass", ev_off[1], ev_on[1]),
    ]
    print(f"{'':46} {'no cache img/s':>15} {'cache img/s':>12} {'ratio':>6}")
    for name, r_off, r_on in rows:
        print(f"{name:46} {r_off:15.1f} {r_on:12.1f} {r_on / r_off:6.2f}")
    result = {
        "data": data,
        "backbone": backbone(False)[1],
        "images": a.images,
        "threads": a.threads,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rows": [{"what": n, "no_cache": r_off, "cache": r_on, "ratio": r_on / r_off} for n, r_off, r_on in rows],
        "train_epochs": {"no_cache": off, "cache": on},
    }
    layout = [
        ("client step on random crops (stem uncached)",
         *(sum(train_epochs(False, x, y, 2, 16, "rrc_flip", cl)) / 2 for cl in (False, True))),
        ("evaluation forward (stem uncached)", *(eval_passes(False, x, 2, cl)[1] for cl in (False, True))),
    ]  # fmt: skip
    print(f"\n{'stem layout':46} {'default img/s':>15} {'NHWC img/s':>12} {'ratio':>6}")
    for name, r_off, r_on in layout:
        print(f"{name:46} {r_off:15.1f} {r_on:12.1f} {r_on / r_off:6.2f}")
    result["stem_layout"] = [{"what": n, "default": a_, "channels_last": b_, "ratio": b_ / a_} for n, a_, b_ in layout]
    result["load_average_after"] = os.getloadavg()
    print(f"load average before {load_before}, after {result['load_average_after']}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
