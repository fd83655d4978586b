"""A tiny random-init CLIP (open_clip's ViT-B-16 config, shrunk) and a long-tailed synthetic config for tests."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import deep_update

pytest.importorskip("open_clip")  # CAPT's default K-means is promptfcl's own: no scikit-learn needed

TINY_CLIP: dict[str, Any] = {
    "kind": "clip",
    "name": "ViT-B-16",
    "img_size": 32,
    "mean": [0.48145466, 0.4578275, 0.40821073],
    "std": [0.26862954, 0.26130258, 0.27577711],
    "kwargs": {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
        "text_cfg": {"context_length": 16, "width": 32, "heads": 2, "layers": 2},
    },
}

TINY_LT: dict[str, Any] = {
    "name": "tiny_lt",
    "seed": 0,
    "data": {"name": "synthetic", "options": {"num_classes": 6, "train_per_class": 40, "test_per_class": 6}},
    "scenario": {
        "kind": "long_tailed",
        "num_tasks": 1,
        "num_clients": 6,
        "rounds_per_task": 2,
        "long_tail": {"imbalance_factor": 10},
        "partition": {"kind": "dirichlet", "beta": 0.5, "min_samples": 1},
        "participation": {"fraction": 0.5, "mode": "per_round"},
    },
    "backbone": TINY_CLIP,
    "method": {"name": "capt", "depth": 2, "lr": 0.05, "batch_size": 16},
    "engine": {"device": "cpu"},
}


def tiny_lt_raw(**updates: Any) -> dict[str, Any]:
    return deep_update(TINY_LT, updates)
