"""The label-free alignment of mini-CLIP: fit the image→text projection (and the logit scale) on unlabeled images.

    promptfcl build-asset mini-clip --out DIR      (same as: python -m promptfcl.assets.mini_clip --out DIR)

Recipe (the defaults; every value is written into the checkpoint's metadata with the sha256 of every input file):
1. Images: the CIFAR-100 *training* images (`--images cifar100:$PROMPTFCL_ASSETS/cifar-100-python`), the first
   `--max-images` in file order; their labels are never read. Why this is fair: no label of any dataset is used,
   the CIFAR-100 test split (where zero-shot accuracy is measured) is never seen, and the image tower (the hybrid
   ViT-Tiny) was itself distilled on CIFAR-10 images only. What the projection learns from these images is where
   CIFAR-like image features lie, not which CIFAR-100 class they belong to. CIFAR-10 (`--images cifar10:DIR`) or any
   image folder works the same way.
2. Teacher: the frozen ImageNet-1k EfficientNet-Lite0 (`promptfcl.assets.sources.load_teacher`, 160 px,
   mean = std = 0.5) gives each image's ImageNet class probabilities p(k|x).
3. Targets, ConSE (Norouzi et al., ICLR 2014): the text tower (all-MiniLM-L6-v2, hash-checked) embeds the 1,000
   ImageNet class names (the first lemma of each synset, timm's lemma file) in the template "a photo of a {}.",
   s(k); the target of image x is normalise(Σ_{k in top-T} p(k|x) s(k)), T = `--conse-top` (Norouzi's 10).
4. Image features: the frozen image tower's CLS feature f(x) (192-d, 112 px, no prompt), computed once.
5. Projection: Linear(192 → 384) with bias, fitted by minimising the mean of 1 − cos(W f(x) + b, target(x)):
   initialised by ridge regression onto the targets, then Adam (`--steps`, `--lr`, `--batch`, `--seed`); a held-out
   `--val-fraction` of the images reports the validation loss. Why linear: CLIP's own image projection is linear;
   it has 74 k parameters for tens of thousands of images (no overfitting to worry about), and it keeps the image
   tower's geometry (its nearest-class-mean and linear-probe content) instead of bending it onto 1,000 ImageNet
   directions, which a wider MLP would do.
6. Logit scale: the one scalar s minimising KL(p(·|x) ‖ softmax_k(s · cos(z(x), s(k)))) over the training images —
   the temperature at which mini-CLIP's own 1,000-way ImageNet zero-shot distribution matches the teacher's (no
   label either).
Teacher probabilities and image features are cached in `--cache` (default OUT/cache) keyed by their inputs, so a
rerun with other fitting settings costs seconds.

`--conse-eval cifar100:DIR` also measures the ConSE-only zero-shot baseline (the teacher's probabilities projected
on the MiniLM embeddings of the ImageNet names, classified by the nearest CIFAR-100 class text "a photo of a
{class}.") on that dataset's test split and writes it to OUT/conse_eval.json (test labels are used only to score).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from promptfcl.assets.sources import (
    AssetError,
    cache_key,
    cached,
    describe_file,
    frozen_map,
    imagenet_class_names,
    load_teacher,
    read_images,
    teacher_transform,
)
from promptfcl.backbones.hybrid import HYBRID_WEIGHTS
from promptfcl.backbones.mini_clip import PROJECTION_FORMAT, TextTower, load_text_tower
from promptfcl.backbones.vit import BackboneError, FrozenViT
from promptfcl.config import BackboneConfig
from promptfcl.data.transforms import ImageTransform

OUT_FILE = "mini_clip_projection.safetensors"
TEMPLATE = "a photo of a {}."


def default_assets(*parts: str) -> str:
    """A path under $PROMPTFCL_ASSETS (left as the variable when it is unset, so the error names it)."""
    return str(Path(os.environ.get("PROMPTFCL_ASSETS", "$PROMPTFCL_ASSETS"), *parts))


@dataclass
class MiniClipRecipe:
    """Everything the alignment depends on (written into the checkpoint's metadata)."""

    images: str = field(default_factory=lambda: "cifar100:" + default_assets("cifar-100-python"))
    max_images: int | None = 12000
    image_model: str = "vit_tiny_hybrid_lite0"
    image_weights: str | None = field(default_factory=lambda: default_assets("models", HYBRID_WEIGHTS))
    image_kwargs: dict[str, Any] = field(default_factory=dict)
    img_size: int = 112
    text_model: str | None = None
    text_sha256: str | None = None
    teacher: str | None = None
    template: str = TEMPLATE
    conse_top: int = 10
    steps: int = 2000
    batch: int = 512
    lr: float = 1e-3
    ridge: float = 1e-2
    val_fraction: float = 0.05
    seed: int = 0
    forward_batch: int = 128


def text_features(text: TextTower, names: list[str], template: str, batch: int = 256) -> torch.Tensor:
    """Normalised MiniLM sentence embeddings (N, 384) of `template.format(name)`."""
    out = []
    with torch.no_grad():
        for i in range(0, len(names), batch):
            tokens = text.tokenize([template.format(n.replace("_", " ")) for n in names[i : i + batch]])
            out.append(F.normalize(text.encode(text.token_embeddings(tokens), tokens), dim=-1))
    return torch.cat(out)


def conse(probs: torch.Tensor, class_text: torch.Tensor, top: int) -> torch.Tensor:
    """ConSE embeddings: normalise(Σ over the top-T classes of p(k|x)·s(k)) (Norouzi et al., 2014)."""
    p, idx = probs.topk(min(top, probs.shape[1]), dim=1)
    return F.normalize(torch.einsum("nt,ntd->nd", p, class_text[idx]), dim=-1)


def image_tower(recipe: MiniClipRecipe) -> FrozenViT:
    from promptfcl.backbones.vit import build_vit

    weights = recipe.image_weights
    if weights and not Path(weights).is_file():
        raise AssetError(
            f"image tower weights {weights} not found: set $PROMPTFCL_ASSETS to the shared assets folder, pass "
            "--image-weights FILE (build one with `promptfcl build-asset hybrid`), or --image-weights none for a "
            "random-init tower (smoke tests only)"
        )
    cfg = BackboneConfig(
        name=recipe.image_model, img_size=recipe.img_size, weights=weights or None, kwargs=recipe.image_kwargs,
        stem_cache=False,
    )  # fmt: skip
    try:
        return build_vit(cfg)
    except BackboneError as e:
        raise AssetError(str(e)) from None


def fit_projection(
    feats: torch.Tensor, targets: torch.Tensor, recipe: MiniClipRecipe, log: Callable[[str], None]
) -> tuple[torch.nn.Linear, dict[str, float]]:
    """Linear(d → e) minimising mean(1 − cos(W f + b, target)): ridge initialisation, then Adam."""
    g = torch.Generator().manual_seed(recipe.seed)
    n = len(feats)
    perm = torch.randperm(n, generator=g)
    n_val = int(round(n * recipe.val_fraction)) if n > 1 else 0
    val, tr = perm[:n_val], perm[n_val:]
    x, y = feats[tr].double(), targets[tr].double()
    xb = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    reg = recipe.ridge * len(x) * torch.eye(xb.shape[1], dtype=x.dtype)
    reg[-1, -1] = 0.0  # no penalty on the bias
    w = torch.linalg.solve(xb.t() @ xb + reg, xb.t() @ y)  # (d + 1, e)
    proj = torch.nn.Linear(feats.shape[1], targets.shape[1])
    with torch.no_grad():
        proj.weight.copy_(w[:-1].t().float())
        proj.bias.copy_(w[-1].float())

    def loss_on(idx: torch.Tensor) -> float:
        if len(idx) == 0:
            return float("nan")
        with torch.no_grad():
            return float((1 - F.cosine_similarity(proj(feats[idx]), targets[idx], dim=-1)).mean())

    start = {"ridge_train_loss": loss_on(tr), "ridge_val_loss": loss_on(val)}
    log(f"  ridge initialisation: train loss {start['ridge_train_loss']:.4f}, held out {start['ridge_val_loss']:.4f}")
    best = (start["ridge_val_loss"] if len(val) else float("inf"), {k: v.clone() for k, v in proj.state_dict().items()})
    opt = torch.optim.Adam(proj.parameters(), lr=recipe.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, recipe.steps))
    for step in range(recipe.steps):
        idx = tr[torch.randint(0, len(tr), (min(recipe.batch, len(tr)),), generator=g)]
        loss = (1 - F.cosine_similarity(proj(feats[idx]), targets[idx], dim=-1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 500 == 499 or step == recipe.steps - 1:
            log(f"  step {step + 1}/{recipe.steps}: batch loss {loss.item():.4f}")
    if len(val) and loss_on(val) > best[0]:  # Adam did not improve on the ridge solution (held-out images)
        proj.load_state_dict(best[1])
        log("  Adam did not lower the held-out loss: keeping the ridge solution")
    end = {"train_loss": loss_on(tr), "val_loss": loss_on(val), "train_images": len(tr), "val_images": len(val)}
    log(f"  fitted: train loss {end['train_loss']:.4f}, held out {end['val_loss']:.4f}")
    return proj.eval(), {**start, **end}


def fit_logit_scale(z: torch.Tensor, class_text: torch.Tensor, probs: torch.Tensor, iters: int = 200) -> float:
    """The scale s in [1, 200] minimising KL(p ‖ softmax(s·cos(z, s_k))) (1-D, on log s, by Adam)."""
    cos = F.normalize(z, dim=-1) @ class_text.t()
    log_s = torch.tensor(float(torch.log(torch.tensor(20.0))), requires_grad=True)
    opt = torch.optim.Adam([log_s], lr=0.05)
    target = probs.clamp_min(1e-12)
    for _ in range(iters):
        s = log_s.exp().clamp(1.0, 200.0)
        loss = F.kl_div(F.log_softmax(s * cos, dim=1), target, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(log_s.detach().exp().clamp(1.0, 200.0))


def build(recipe: MiniClipRecipe, out: Path, cache: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Run the recipe; write OUT/mini_clip_projection.safetensors (tensors + metadata) and return its path."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    cache = cache or out / "cache"
    images = read_images(recipe.images, limit=recipe.max_images)
    log(f"images: {len(images)} from {recipe.images} (labels unused)")
    try:
        text = load_text_tower(recipe.text_model, recipe.text_sha256)
    except BackboneError as e:
        raise AssetError(str(e)) from None
    names = imagenet_class_names()
    class_text = text_features(text, names, recipe.template)
    teacher, teacher_path = load_teacher(recipe.teacher)
    inputs: dict[str, Any] = {
        "teacher_weights": describe_file(teacher_path),
        "text_weights": describe_file(Path(text.folder or ".") / "model.safetensors"),
        "images": {"source": recipe.images, "count": len(images), "files": images.files},
    }
    if recipe.image_weights:
        inputs["image_weights"] = describe_file(Path(recipe.image_weights))
    tower = image_tower(recipe)
    base = [recipe.images, len(images), sorted(images.files.values())]
    probs = cached(
        cache / f"teacher_probs_{cache_key(base, inputs['teacher_weights']['sha256'])}.npy",
        lambda: frozen_map(lambda x: teacher(x).softmax(dim=1), images.images, teacher_transform(),
                           recipe.forward_batch, log=log, what="teacher"),  # fmt: skip
        log,
    )
    img_tf = ImageTransform(recipe.img_size, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic")
    tower_id = [recipe.image_model, recipe.image_kwargs, recipe.img_size, inputs.get("image_weights", {}).get("sha256")]
    feats = cached(
        cache / f"image_features_{cache_key(base, tower_id)}.npy",
        lambda: frozen_map(tower, images.images, img_tf, recipe.forward_batch, log=log, what="image tower"),
        log,
    )
    targets = conse(probs, class_text, recipe.conse_top)
    log("fitting the projection")
    torch.manual_seed(recipe.seed)
    proj, result = fit_projection(feats, targets, recipe, log)
    with torch.no_grad():
        z = proj(feats)
    scale = fit_logit_scale(z, class_text, probs)
    result["logit_scale"] = scale
    result["seconds"] = time.perf_counter() - t0
    log(f"  logit scale {scale:.2f}")
    tensors = {
        "projection.weight": proj.weight.detach().contiguous(),
        "projection.bias": proj.bias.detach().contiguous(),
        "logit_scale": torch.tensor(scale),
    }
    meta = {
        "format": PROJECTION_FORMAT,
        "recipe": json.dumps(asdict(recipe), sort_keys=True),
        "inputs": json.dumps(inputs, sort_keys=True),
        "result": json.dumps(result, sort_keys=True),
        "image_tower": recipe.image_model,
        "text_tower": "sentence-transformers/all-MiniLM-L6-v2 (mean pooling)",
        "teacher": "EfficientNet-Lite0, ImageNet-1k (timm tf_efficientnet_lite0)",
        "method": "ConSE targets (top-T) of the teacher's ImageNet probabilities; cosine regression; no label used",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / OUT_FILE
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    log(f"written {path} ({path.stat().st_size:,} bytes, {result['seconds']:.0f} s)")
    return path


def conse_eval(
    recipe: MiniClipRecipe,
    spec: str,
    out: Path,
    cache: Path,
    limit: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """ConSE-only zero-shot top-1 (%) on the test split of `spec` (cifar100:DIR or cifar10:DIR), its first `limit`
    images when given."""
    from promptfcl.data.base import DataMissingError
    from promptfcl.data.cifar import CifarOptions, load_cifar10, load_cifar100

    kind, _, arg = spec.partition(":")
    loader = {"cifar100": load_cifar100, "cifar10": load_cifar10}.get(kind)
    if loader is None:
        raise AssetError(f"--conse-eval takes cifar100:DIR or cifar10:DIR, not {spec!r}")
    try:
        ds = loader(Path(arg).expanduser(), CifarOptions(), False)
    except DataMissingError as e:
        raise AssetError(str(e)) from None
    images, targets = ds.test.images[:limit], ds.test.targets[:limit]
    text = load_text_tower(recipe.text_model, recipe.text_sha256)
    teacher, teacher_path = load_teacher(recipe.teacher)
    probs = cached(
        cache / f"teacher_probs_{cache_key(spec, 'test', len(images), str(teacher_path))}.npy",
        lambda: frozen_map(lambda x: teacher(x).softmax(dim=1), images, teacher_transform(),
                           recipe.forward_batch, log=log, what="teacher (test)"),  # fmt: skip
        log,
    )
    emb = conse(probs, text_features(text, imagenet_class_names(), recipe.template), recipe.conse_top)
    classes = text_features(text, ds.class_names, recipe.template)
    pred = (emb @ classes.t()).argmax(dim=1)
    acc = 100.0 * float((pred == targets).double().mean())
    res = {"dataset": spec, "test_images": len(images), "conse_top": recipe.conse_top, "zero_shot_top1": acc,
           "chance": 100.0 / len(ds.class_names), "template": recipe.template}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "conse_eval.json").write_text(json.dumps(res, indent=2))
    log(f"ConSE-only zero-shot top-1 on {len(images)} test images: {acc:.2f} % (chance {res['chance']:.2f} %)")
    return res


def recipe_from_args(args: argparse.Namespace) -> MiniClipRecipe:
    r = MiniClipRecipe()
    for key in ("images", "max_images", "image_model", "text_model", "text_sha256", "teacher", "conse_top",
                "steps", "batch", "lr", "seed", "img_size"):  # fmt: skip
        value = getattr(args, key, None)
        if value is not None:
            setattr(r, key, value)
    if args.image_weights is not None:
        r.image_weights = None if args.image_weights == "none" else args.image_weights
    if args.max_images == 0:
        r.max_images = None
    if args.image_depth is not None:
        r.image_kwargs = {"depth": args.image_depth}
    return r


def run(args: argparse.Namespace) -> int:
    """`promptfcl build-asset mini-clip` / `python -m promptfcl.assets.mini_clip`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = recipe_from_args(args)
    out = Path(args.out)
    cache = Path(args.cache) if args.cache else out / "cache"
    if not args.skip_build:
        build(recipe, out, cache)
    if args.conse_eval:
        conse_eval(recipe, args.conse_eval, out, cache, args.conse_eval_max)
    return 0


def main(argv: list[str] | None = None) -> int:
    from promptfcl.assets.arguments import add_mini_clip_arguments, script_main

    return script_main("python -m promptfcl.assets.mini_clip", __doc__, add_mini_clip_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
