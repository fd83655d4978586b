"""The cross-client class gap of the frozen features, with and without per-client image domains, on CIFAR-100.

Builds `configs/cpu/c2prompt_cifar100_domains.yaml`'s run (real CIFAR-100, the hybrid ViT-Tiny at 112 px, the
asynchronous scenario with `slice_rule: disjoint` and `domains: {clients: mixed}`), takes the first `--classes`
classes that two clients train on (each client's own disjoint images of it, the first `--per-client` of them) and
measures the unprompted feature q(x) of those images twice: each client's images through its own domain, and the
same images as stored (the no-domain control). For each (class, client pair) the gap is ‖μ_a − μ_b‖ / s
(`promptfcl.statistics.client_gap`); its sampling floor √(1/n_a + 1/n_b) is what two samples of one distribution
give. `between_class` is the same ratio for two different classes of one client, for scale. Also times the domain
transforms against the q(x) forwards of the same images. The load average is recorded before and after.

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/domain_gap.py [--classes 8] [--per-client 20] \\
        [--out benchmarks/results/domain_gap.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from promptfcl.config import load_config
from promptfcl.runtime import Runtime
from promptfcl.statistics.client_gap import client_class_features, client_class_gap, shared_class_holdings

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/cpu/c2prompt_cifar100_domains.yaml"))
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--per-client", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/domain_gap.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rt = Runtime.build(load_config(args.config))
    s, train, tf, query = rt.scenario, rt.dataset.train, rt.env.eval_transform, rt.env.backbone.query
    rt.env.backbone.enable_query_cache(False)
    common = (query, s, train, tf, rt.device, args.classes, 2, args.per_client)
    out: dict = {"config": os.path.relpath(args.config, ROOT), "seed": rt.cfg.seed, "backbone": rt.cfg.backbone.name}
    out["client_domains"] = [d.describe() for d in s.domains or []]
    for name, on in (("domains", True), ("no_domains", False)):
        t0 = time.perf_counter()
        gap = client_class_gap(*client_class_features(*common, domains=on))
        out[name] = {**gap.as_dict(), "seconds": time.perf_counter() - t0}
    # the domains' own cost, against q(x) on the same images
    holdings = list(shared_class_holdings(s, train.targets.numpy()).values())[: args.classes]
    batches = [
        (k, train.images[torch.as_tensor(idx[: args.per_client])]) for h in holdings for k, idx in list(h.items())[:2]
    ]
    t0 = time.perf_counter()
    shifted = [s.client_domain(k)(x) if s.client_domain(k) else x for k, x in batches]
    t_domain = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        for x in shifted:
            query(tf(x))
    out["seconds_domain_transforms"], out["seconds_q_forwards"] = t_domain, time.perf_counter() - t0
    out["loadavg_before"], out["loadavg_after"] = list(load_before), list(os.getloadavg())
    for name in ("domains", "no_domains"):
        r = out[name]
        print(
            f"{name:>10}: gap {r['gap']:.3f} (floor {r['floor']:.3f}, ×{r['gap_over_floor']:.2f}), between classes "
            f"{r['between_class']:.3f}, {r['pairs']} pairs, {r['samples']} images"
        )
    print("per pair (class, clients: gap with / without domains):")
    for a, b in zip(out["domains"]["per_pair"], out["no_domains"]["per_pair"], strict=True):
        doms = " vs ".join(out["client_domains"][k] for k in a["clients"])
        print(f"  class {a['class']:>3}, clients {a['clients']} ({doms}): {a['gap']:.2f} / {b['gap']:.2f}")
    print(f"domain transforms {t_domain:.3f} s, q(x) forwards {out['seconds_q_forwards']:.2f} s on the same images")
    print(f"load average before {out['loadavg_before']}, after {out['loadavg_after']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
