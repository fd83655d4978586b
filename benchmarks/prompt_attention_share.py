"""Why a prefix-prompt pool barely moves the features (the validity gate's `prompt_effect`): how much attention the
prefix tokens draw and how large they are next to the image tokens' keys and values.

A prefix (keys P_k, values P_v) changes a block's output only through the softmax share it takes from the image
tokens and the values it adds in its place. This script loads a finished run's final global model and, at every
prompted layer, on test images reports: the prefix's mean attention share (over heads, over every query token and
for the CLS query), the ratio of the prefix keys' and values' per-head norms to the image tokens', the CODA-P
component weights |α| (mean), and the 1 − cos of the prompted vs prompt-free CLS feature.

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/prompt_attention_share.py RUN_DIR [...] \\
        --out benchmarks/results/prompt_attention_share.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from promptfcl.backbones.vit import attention_qkv
from promptfcl.runtime import Runtime


@torch.no_grad()
def layer_shares(model: torch.nn.Module, x: torch.Tensor) -> dict[int, dict[str, float]]:
    """Per prompted layer: attention share of the prefix and its key / value norms relative to the image tokens'."""
    backbone = model.backbone
    query = backbone.query(x) if getattr(model.prompt, "needs_query", False) else None
    spec = model.prompt(len(x), query)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        blk.norm1.register_forward_hook(lambda _m, _i, out, i=i: inputs.__setitem__(i, out))
        for i, blk in enumerate(backbone.vit.blocks)
        if i in spec.prefix
    ]
    try:
        backbone(x, spec)
    finally:
        for h in hooks:
            h.remove()
    rows = {}
    for i, xn in inputs.items():
        attn = backbone.vit.blocks[i].attn
        q, k, v = attention_qkv(attn, xn, spec.prefix[i])  # the prefix is the first L keys / values
        L = spec.prefix[i][0].shape[-2]
        share = ((q @ k.transpose(-1, -2)) * attn.scale).softmax(-1)[..., :L].sum(-1)  # (B, heads, tokens)
        rows[i] = {
            "prefix_share_all_tokens": float(share.mean()),
            "prefix_share_cls": float(share[..., 0].mean()),
            "key_norm_ratio": float(k[:, :, :L].norm(dim=-1).mean() / k[:, :, L:].norm(dim=-1).mean()),
            "value_norm_ratio": float(v[:, :, :L].norm(dim=-1).mean() / v[:, :, L:].norm(dim=-1).mean()),
        }
    return rows


@torch.no_grad()
def diagnose(run: Path, images: int) -> dict:
    rt, server = Runtime.restore_server(run)
    model = server.global_model().eval()
    pool = torch.as_tensor(np.concatenate([np.asarray(i) for i in rt.scenario.test_indices]))  # the run's classes
    idx = pool[torch.randperm(len(pool), generator=torch.Generator().manual_seed(0))[:images]]
    x = rt.env.eval_transform(rt.dataset.test.images[idx]).to(rt.device)
    per_layer: dict[int, list[dict[str, float]]] = {}
    shifts, alphas = [], []
    for chunk in x.split(64):
        for layer, row in layer_shares(model, chunk).items():
            per_layer.setdefault(layer, []).append(row)
        on = model.features(chunk)
        with model.backbone.prompts_disabled():
            off = model.features(chunk)
        shifts.append(float((1 - F.cosine_similarity(on, off, dim=1)).mean()))
        weights = getattr(model.prompt, "component_weights", None)
        if weights is not None:
            alphas.append(float(weights(model.backbone.query(chunk), 0).abs().mean()))
    layers = {
        str(layer): {k: statistics.mean(r[k] for r in rows) for k in rows[0]} for layer, rows in per_layer.items()
    }
    return {
        "run": str(run),
        "method": rt.cfg.method.name,
        "images": len(x),
        "feature_shift_1_minus_cos": statistics.mean(shifts),
        "mean_abs_alpha_layer0": statistics.mean(alphas) if alphas else None,
        "layers": layers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/prompt_attention_share.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    for run in args.runs:
        r = diagnose(run, args.images)
        rows.append(r)
        print(f"{r['run']}: 1-cos {r['feature_shift_1_minus_cos']:.4f}, |alpha| {r['mean_abs_alpha_layer0']}")
        for layer, v in r["layers"].items():
            print(f"  layer {layer}: " + ", ".join(f"{k} {val:.4f}" for k, val in v.items()))
    Path(args.out).write_text(json.dumps({"load_average": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
