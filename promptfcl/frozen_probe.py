"""The frozen-feature probe of a configured backbone: `promptfcl probe CONFIG` and a study's probe row.

- `probe_backbone(cfg, …)`: the CPU-scale assets' protocol on the configured dataset — the first N training images
  of each class (default 100), the whole test split — nearest class mean and linear probe over every class and over
  the first K class ids (default 20), so any backbone can be judged against `../shared/assets/models/README.md`.
- `probe_run(cfg, run_dir)`: the reference row of a study family (a cell with `probe: true`): the same probe on
  exactly the training images and classes the family's scenario uses (every client's data pooled), tested on
  those classes' test images, task-agnostic (all classes compete) and task-aware (each task's classes compete);
  written as a run directory whose `metrics.json` marks it `upper_bound: frozen_probe`, so summaries and reports
  show it beside the federated rows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from promptfcl.checkpoint import atomic_write_text
from promptfcl.config import ConfigError, ExperimentConfig, dump_config
from promptfcl.data import resolve_root
from promptfcl.data.cache import materialize
from promptfcl.data.transforms import ImageTransform
from promptfcl.environment import environment_info
from promptfcl.evaluation.probe import first_per_class, frozen_features, probe
from promptfcl.report.results import clean_json
from promptfcl.runtime import (
    Runtime,
    check_config,
    image_cache_dir,
    resolve_dataset_options,
    resolve_device,
    shared_backbone,
)


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
    """{"all": …, "first_<K>": …} probe results of the configured frozen backbone on the configured dataset."""
    check_config(cfg)
    if cfg.backbone.kind != "timm":
        raise ValueError("promptfcl probe reads a timm ViT's CLS feature; backbone.kind: clip is not supported")
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
    out["protocol"] = {
        "backbone": cfg.backbone.name,
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
