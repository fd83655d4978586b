"""Query-cache speed-up of pool methods' client step: the same client program with q(x) cached vs recomputed.

For each pool method the real client step (`SupervisedClient.handle`: transforms, query, pool prompts, prefixed
forward/backward, Adam) runs `--epochs` local epochs on the same images, once with the backbone's query cache
and once without. Reported: images/s of the whole client step (first epoch fills the cache), images/s of the
steady state (epochs after the first, every query a hit), and their ratios. Flip augmentation (the cache keys
the two orientations), ViT-Tiny at 112 px, batch 16, random-init weights (speed does not depend on them).

    python benchmarks/query_cache_speedup.py [--images 160] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from promptfcl.backbones.vit import build_vit
from promptfcl.config import BackboneConfig
from promptfcl.data.loader import LabeledSubset
from promptfcl.data.synthetic import SyntheticOptions, load_synthetic
from promptfcl.data.transforms import ImageTransform
from promptfcl.federation.message import Message, Record
from promptfcl.federation.protocol import ClientContext, MethodEnv
from promptfcl.methods import METHODS
from promptfcl.scenario.label_space import LabelSpace

POOLS = {
    "fedavg_prompt_pool": {"pool_size": 100},
    "fedcodap": {},
    "fedl2p": {},
    "feddualprompt": {},
}


def run(method: str, extra: dict, cached: bool, epochs: int, args: argparse.Namespace) -> tuple[float, float]:
    """(images/s over all epochs, images/s over epochs 2..E) of one client handling one message."""
    backbone = build_vit(BackboneConfig(name="vit_tiny_patch16_224", img_size=args.img_size))
    classes = 10
    ds = load_synthetic(None, SyntheticOptions(num_classes=classes, train_per_class=args.images // classes), False)
    space = LabelSpace([list(range(classes))], classes)
    spec = METHODS.get(method)
    base = {"batch_size": args.batch, "augment": "flip", "query_cache": cached, **extra}
    env = MethodEnv(backbone, space, ImageTransform(args.img_size), torch.device("cpu"), seed=0)
    data = LabeledSubset.of(ds.train, torch.arange(len(ds.train)), space.class_to_logit)
    times = []
    for e in range(epochs):  # one epoch per message, so each epoch is timed on its own
        params = spec.params.model_validate({**base, "local_epochs": 1})
        server, client = spec.programs(env, params)
        msg = Message(server.model.get_state(), {"task": 0, "round": e}, kind="train")
        ctx = ClientContext(0, 0, e, Record(), data, e, torch.device("cpu"))
        t0 = time.perf_counter()
        client.handle(msg, ctx)
        times.append(time.perf_counter() - t0)
    n = len(data)
    return n * epochs / sum(times), n * (epochs - 1) / sum(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--img-size", type=int, default=112)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--images", type=int, default=160)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/query_cache_speedup.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print("| method | recomputed img/s | cached img/s (all epochs) | ratio | cached img/s (warm) | warm ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for method, extra in POOLS.items():
        off_all, off_warm = run(method, extra, False, args.epochs, args)
        on_all, on_warm = run(method, extra, True, args.epochs, args)
        row = {
            "method": method,
            "uncached_images_per_s": off_warm,
            "cached_images_per_s_all_epochs": on_all,
            "ratio_all_epochs": on_all / off_all,
            "cached_images_per_s_warm": on_warm,
            "ratio_warm": on_warm / off_warm,
        }
        rows.append(row)
        print(
            f"| {method} | {off_warm:.1f} | {on_all:.1f} | {row['ratio_all_epochs']:.2f} | {on_warm:.1f} | "
            f"{row['ratio_warm']:.2f} |",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"img_size": args.img_size, "batch": args.batch, "epochs": args.epochs,
                               "threads": torch.get_num_threads(), "rows": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
