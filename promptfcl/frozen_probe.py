"""The frozen-feature probe: what a frozen backbone's features are worth on their own, and the probe row of a study.

Protocol (the CPU-scale assets', `../shared/assets/models/README.md`): features are the frozen backbone's
final-norm CLS token without prompts on eval-transformed images; the nearest class mean classifies a test feature by
the closest class mean (Euclidean) of the training features; the linear probe is an L2-regularised multinomial
logistic regression on standardised features (mean and std of the training features), its strength C chosen on a
held-out fifth of the training images (seeded, stratified) from `C_GRID` and then refitted on all of them. The
objective is scikit-learn's: C · Σ_i CE_i + ½‖W‖² (bias not penalised), solved with L-BFGS in float64.

A CLIP backbone (`backbone.kind: clip`, the CPU stand-in mini-CLIP included) is probed on its normalised image
feature, and `promptfcl probe` also reports its zero-shot top-1 ("a photo of a {class}.", nearest class text).

Two entry points share it:
- `probe_backbone(cfg, …)` (`promptfcl probe CONFIG`): the assets' protocol on the configured dataset — the first N
  training images of each class (default 100), the whole test split — nearest class mean and linear probe over
  every class and over the first K class ids (default 20), so any backbone can be judged against the assets README.
- `probe_run(cfg, run_dir)` (a study cell with `probe: true`): the reference row of a study family — the same probe
  on exactly the training images and classes the family's scenario uses (every client's data pooled), tested on
  those classes' test images, task-agnostic (all classes compete) and task-aware (each task's classes compete);
  written as a run directory whose `metrics.json` marks it `upper_bound: frozen_probe`, so summaries and reports
  show it beside the federated rows.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from promptfcl.checkpoint import atomic_write_text
from promptfcl.config import ConfigError, ExperimentConfig, dump_config
from promptfcl.data import resolve_root
from promptfcl.data.base import ImageSplit
from promptfcl.data.cache import materialize
from promptfcl.data.transforms import ImageTransform
from promptfcl.environment import environment_info
from promptfcl.report.results import clean_json
from promptfcl.runtime import (
    Runtime,
    check_config,
    image_cache_dir,
    resolve_dataset_options,
    resolve_device,
    shared_backbone,
)

C_GRID = (0.001, 0.01, 0.1, 1.0, 10.0)


@torch.no_grad()
def frozen_features(
    backbone: torch.nn.Module, split: ImageSplit, transform: ImageTransform, batch_size: int, device: torch.device
) -> torch.Tensor:
    """(N, d) unprompted features of every image of `split`, in order (float32, on the CPU)."""
    clip = hasattr(backbone, "encode_image")  # a CLIP backbone: its normalised image feature
    out = []
    for start in range(0, len(split), batch_size):
        x = transform(split.images[start : start + batch_size].to(device))
        out.append((backbone.encode_image(x) if clip else backbone(x, None)).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0)


ZERO_SHOT_TEMPLATE = "a photo of a {}."


@torch.no_grad()
def zero_shot(
    backbone: Any,
    features: torch.Tensor,
    targets: torch.Tensor,
    class_names: list[str],
    classes: list[int] | None = None,
) -> dict[str, Any]:
    """Zero-shot top-1 (%) of a CLIP backbone: each test feature takes the class whose text "a photo of a {class}."
    is nearest (cosine), over `classes` (default all); no training image is used."""
    ids = list(range(len(class_names))) if classes is None else list(classes)
    texts = [ZERO_SHOT_TEMPLATE.format(class_names[c].replace("_", " ")) for c in ids]
    tokens = backbone.tokenize(texts)
    text = backbone.encode_text(backbone.token_embeddings(tokens), tokens).float().cpu()
    keep = torch.isin(targets, torch.tensor(ids))
    pred = torch.tensor(ids)[(F.normalize(features[keep], dim=-1) @ text.t()).argmax(dim=1)]
    top1 = 100.0 * float((pred == targets[keep]).double().mean()) if keep.any() else float("nan")
    return {"classes": len(ids), "test_images": int(keep.sum()), "top1": top1, "chance": 100.0 / len(ids),
            "template": ZERO_SHOT_TEMPLATE}  # fmt: skip


def first_per_class(targets: torch.Tensor, per_class: int | None, classes: list[int] | None = None) -> np.ndarray:
    """Indices of the first `per_class` images (in split order) of each class in `classes` (None: all)."""
    t = targets.numpy()
    keep = [np.flatnonzero(t == c)[:per_class] for c in (np.unique(t) if classes is None else classes)]
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)


def nearest_class_mean(ftr: torch.Tensor, ytr: torch.Tensor, fte: torch.Tensor, yte: torch.Tensor) -> float:
    """Accuracy (%) of the nearest training-class mean (Euclidean) over the classes present in `ytr`."""
    classes = torch.unique(ytr)
    means = torch.stack([ftr[ytr == c].double().mean(0) for c in classes])
    pred = classes[torch.cdist(fte.double(), means).argmin(dim=1)]
    return 100.0 * float((pred == yte).double().mean())


def _fit_logistic(x: torch.Tensor, y: torch.Tensor, n_classes: int, c: float, iters: int = 300) -> torch.Tensor:
    """Weights (d + 1, K) minimising C·Σ CE + ½‖W‖² (bias row unpenalised), L-BFGS in float64."""
    w = torch.zeros(x.shape[1] + 1, n_classes, dtype=torch.float64, requires_grad=True)
    xb = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=iters, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")  # fmt: skip

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = c * F.cross_entropy(xb @ w, y, reduction="sum") + 0.5 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach()


def _predict(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1) @ w).argmax(dim=1)


def linear_probe(
    ftr: torch.Tensor,
    ytr: torch.Tensor,
    fte: torch.Tensor,
    yte: torch.Tensor,
    seed: int = 0,
    grid: tuple[float, ...] = C_GRID,
    task_groups: list[list[int]] | None = None,
) -> tuple[float, float, float | None]:
    """(test accuracy %, chosen C, task-aware accuracy %) of the L2 logistic-regression probe.

    Labels may be any class ids; C is chosen on a stratified fifth of the training set held out with `seed`.
    `task_groups` (lists of class ids): also report the mean over groups of the accuracy when only the group's
    classes compete (the task-aware reading), else None."""
    classes, y_all = torch.unique(ytr, return_inverse=True)
    lookup = {int(c): i for i, c in enumerate(classes)}
    if not all(int(c) in lookup for c in torch.unique(yte)):
        raise ValueError("the probe's test set holds classes it has no training images of")
    yte_i = torch.tensor([lookup[int(c)] for c in yte])
    mu, sd = ftr.double().mean(0), ftr.double().std(0).clamp_min(1e-8)
    xtr, xte = (ftr.double() - mu) / sd, (fte.double() - mu) / sd
    rng = np.random.default_rng(seed)
    held = np.zeros(len(y_all), dtype=bool)
    for c in range(len(classes)):
        idx = np.flatnonzero(y_all.numpy() == c)
        held[rng.permutation(idx)[: len(idx) // 5]] = True
    fit, val = torch.from_numpy(~held), torch.from_numpy(held)
    best_c, best_acc = grid[0], -1.0
    for c in grid:
        w = _fit_logistic(xtr[fit], y_all[fit], len(classes), c)
        acc = float((_predict(w, xtr[val]) == y_all[val]).double().mean()) if val.any() else 0.0
        if acc > best_acc + 1e-12:
            best_c, best_acc = c, acc
    w = _fit_logistic(xtr, y_all, len(classes), best_c)
    logits = torch.cat([xte, torch.ones(len(xte), 1, dtype=torch.float64)], dim=1) @ w
    accuracy = 100.0 * float((logits.argmax(dim=1) == yte_i).double().mean())
    aware = None
    if task_groups:
        accs = []
        for group in task_groups:
            cols = torch.tensor([lookup[c] for c in group if c in lookup], dtype=torch.long)
            rows = torch.isin(yte_i, cols)
            if rows.any():
                pred = cols[logits[rows][:, cols].argmax(dim=1)]
                accs.append(100.0 * float((pred == yte_i[rows]).double().mean()))
        aware = sum(accs) / len(accs) if accs else None
    return accuracy, best_c, aware


@dataclass
class ProbeResult:
    """Frozen-feature accuracies on one set of classes (percent)."""

    classes: int
    train_images: int
    test_images: int
    ncm: float
    linear: float
    linear_c: float
    task_aware: float | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        return dict(self.__dict__)


def probe(
    ftr: torch.Tensor,
    ytr: torch.Tensor,
    fte: torch.Tensor,
    yte: torch.Tensor,
    seed: int = 0,
    task_groups: list[list[int]] | None = None,
) -> ProbeResult:
    """Nearest class mean and linear probe on precomputed features (labels: class ids)."""
    if len(ftr) == 0 or len(fte) == 0:
        raise ValueError("the probe needs training and test images")
    linear, c, aware = linear_probe(ftr, ytr, fte, yte, seed, task_groups=task_groups)
    ncm = nearest_class_mean(ftr, ytr, fte, yte)
    return ProbeResult(len(torch.unique(ytr)), len(ftr), len(fte), ncm, linear, c, aware)


def _backbone(cfg: ExperimentConfig, device: torch.device) -> tuple[torch.nn.Module, ImageTransform]:
    b = cfg.backbone.model_copy(update={"stem_cache": False})  # every image is seen once: a cache only costs
    backbone = shared_backbone(cfg.model_copy(update={"backbone": b}), device)
    return backbone, ImageTransform(b.img_size, b.mean, b.std, b.interpolation)


def probe_backbone(
    cfg: ExperimentConfig,
    train_per_class: int | None = 100,
    test_per_class: int | None = None,
    first_classes: int | None = 20,
    batch_size: int = 256,
) -> dict[str, Any]:
    """{"all": …, "first_<K>": …} probe results of the configured frozen backbone on the configured dataset; a CLIP
    backbone (`backbone.kind: clip`, mini-CLIP included) is probed on its image features and also gets
    `"zero_shot"` (and `"zero_shot_first_<K>"`): its zero-shot top-1 on the same test images."""
    check_config(cfg)
    spec, options = resolve_dataset_options(cfg)
    ds = spec.load(resolve_root(spec, cfg.data.root), options, cfg.data.download)
    device = resolve_device(cfg)
    backbone, tf = _backbone(cfg, device)
    cache, workers = image_cache_dir(cfg), cfg.data.decode_workers
    tr = materialize(ds.train.subset(first_per_class(ds.train.targets, train_per_class)), spec.name, "train", cache,
                     workers)  # fmt: skip
    te = materialize(ds.test.subset(first_per_class(ds.test.targets, test_per_class)), spec.name, "test", cache,
                     workers)  # fmt: skip
    ftr, fte = (frozen_features(backbone, s, tf, batch_size, device) for s in (tr, te))
    out: dict[str, Any] = {"all": probe(ftr, tr.targets, fte, te.targets, cfg.seed).as_dict()}
    if first_classes and first_classes < ds.num_classes:
        a, b = tr.targets < first_classes, te.targets < first_classes
        out[f"first_{first_classes}"] = probe(ftr[a], tr.targets[a], fte[b], te.targets[b], cfg.seed).as_dict()
    if cfg.backbone.kind == "clip":
        out["zero_shot"] = zero_shot(backbone, fte, te.targets, ds.class_names)
        if first_classes and first_classes < ds.num_classes:
            first = list(range(first_classes))
            out[f"zero_shot_first_{first_classes}"] = zero_shot(backbone, fte, te.targets, ds.class_names, first)
    out["protocol"] = {
        "backbone": cfg.backbone.name,
        "kind": cfg.backbone.kind,
        "weights": cfg.backbone.weights,
        "dataset": cfg.data.name,
        "train_per_class": train_per_class,
        "test_per_class": test_per_class,
        "img_size": cfg.backbone.img_size,
    }
    return out


def probe_run(cfg: ExperimentConfig, run_dir: Path) -> dict[str, Any]:
    """The probe row of a study family: the scenario's own training images and classes; writes `run_dir`."""
    t0 = time.perf_counter()
    rt = Runtime.build(cfg)
    sc, train, test = rt.scenario, rt.dataset.train, rt.dataset.test
    if sc.domains is not None:
        raise ConfigError(
            "a probe cell pools every client's images, but scenario.domains shows each client its images in its own "
            "domain; drop probe: true from this family or scenario.domains from its base config"
        )
    tr_idx = np.unique(np.concatenate([np.asarray(i) for row in sc.client_train for i in row if len(i)]))
    # classes of the label space that no client holds a training image of (a Dirichlet split can leave a task's
    # class empty on its only client) have nothing to fit: scored without them, and their count recorded
    trained = {int(c) for c in np.unique(train.targets.numpy()[tr_idx])}
    listed = {int(c) for t in sc.label_space.tasks for c in t.classes}
    classes, untrained = sorted(listed & trained), sorted(listed - trained)
    te_idx = np.flatnonzero(np.isin(test.targets.numpy(), classes))
    backbone, tf = _backbone(cfg, rt.device)
    tr, te = train.subset(tr_idx), test.subset(te_idx)
    ftr, fte = (frozen_features(backbone, s, tf, cfg.eval.batch_size, rt.device) for s in (tr, te))
    groups = [g for t in sc.label_space.tasks if (g := sorted({int(c) for c in t.classes} & trained))]
    res = probe(ftr, tr.targets, fte, te.targets, cfg.seed, task_groups=groups)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    sc.save(run_dir / "scenario.json", train.targets.numpy())  # what claims pair it on, as every run
    (run_dir / "environment.json").write_text(json.dumps(environment_info(), indent=2))
    task_aware = sc.schedule is not None or sc.personalized
    main = res.task_aware if task_aware and res.task_aware is not None else res.linear
    metrics = {
        "method": "frozen_probe",
        "run": cfg.run_name(),
        "seed": cfg.seed,
        "upper_bound": "frozen_probe",
        "summary": {
            "faa": main,
            "probe_linear": res.linear,
            "probe_ncm": res.ncm,
            "probe_task_aware": res.task_aware,
            "probe_c": res.linear_c,
        },
        "probe": {**res.as_dict(), "classes_without_training_images": untrained},
        "accuracy_matrix": [],
        "accuracy_curve": [],
        "communication": {"bytes_up": 0, "bytes_down": 0, "rounds": 0, "mb_per_round": 0.0},
        "timing": {"total_seconds": time.perf_counter() - t0},
    }
    atomic_write_text(run_dir / "metrics.json", json.dumps(clean_json(metrics), indent=2))
    return metrics
