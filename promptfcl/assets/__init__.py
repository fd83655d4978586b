"""Builders of the CPU-scale pretrained assets, from public parts, each one command that writes a safetensors file
whose metadata carries its recipe and the sha256 of every input file:

- `promptfcl build-asset hybrid --out DIR` (`promptfcl.assets.hybrid`): the hybrid ViT-Tiny backbone
  `vit_tiny_hybrid_lite0` — a ViT-Tiny on the frozen ImageNet EfficientNet-Lite0 stem, feature-distilled from that
  CNN on unlabeled CIFAR-10 images;
- `promptfcl build-asset mini-clip --out DIR` (`promptfcl.assets.mini_clip`): mini-CLIP's image→text projection,
  fitted without labels to the ConSE embedding of the same CNN's ImageNet predictions.

`mini_clip_projection.safetensors` beside this file is the projection mini-CLIP loads by default (its sha256 is
pinned in `promptfcl.backbones.mini_clip`). This package's `__init__` and `arguments` are torch-free: they only
define the command line.
"""

from __future__ import annotations

import argparse
from typing import Any

from promptfcl.assets.arguments import add_hybrid_arguments, add_mini_clip_arguments


def _run_mini_clip(args: argparse.Namespace) -> Any:
    from promptfcl.assets.mini_clip import run

    return run(args)


def _run_hybrid(args: argparse.Namespace) -> Any:
    from promptfcl.assets.hybrid import run

    return run(args)


def add_build_asset_parser(sub: Any) -> None:
    """`promptfcl build-asset {mini-clip,hybrid}` on the CLI's subparsers."""
    ba = sub.add_parser(
        "build-asset",
        help="build a CPU-scale pretrained asset from public parts (hybrid ViT-Tiny, mini-CLIP projection); the "
        "checkpoint's metadata records its recipe and input hashes",
    )
    kinds = ba.add_subparsers(dest="asset", required=True)
    mc = kinds.add_parser("mini-clip", help="mini-CLIP's label-free image→text projection (ConSE targets)")
    add_mini_clip_arguments(mc)
    mc.set_defaults(func=_run_mini_clip)
    hy = kinds.add_parser("hybrid", help="the hybrid ViT-Tiny on the EfficientNet-Lite0 stem, distilled label-free")
    add_hybrid_arguments(hy)
    hy.set_defaults(func=_run_hybrid)
