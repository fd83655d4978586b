"""Long-tailed scenarios (IF subsampling or the dataset's own counts → Dirichlet over clients, T = 1) and
head/mid/tail evaluation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from promptfcl.config import ConfigError, ScenarioConfig, build_config
from promptfcl.evaluation.metrics import class_group_accuracy
from promptfcl.runtime import Runtime, check_config
from promptfcl.scenario.long_tail import build_long_tailed, class_groups, long_tail_counts
from promptfcl.scenario.partition import PartitionError
from promptfcl.scenario.scenario import Scenario

from .conftest import tiny_raw
from .test_datasets import _write_image


@pytest.mark.parametrize("imbalance", [100, 50, 10])
def test_exponential_profile_has_the_imbalance_factor(imbalance) -> None:
    counts = long_tail_counts(500, 10, imbalance)
    assert counts[0] == 500 and counts[-1] == 500 // imbalance
    assert all(a >= b for a, b in zip(counts, counts[1:], strict=False))
    assert counts[3] == int(500 * imbalance ** (-3 / 9))


def test_groups_by_cumulative_share() -> None:
    # shares before each class: 0, .50, .75, .85, .95, .98 → head, head, mid, mid, tail, tail
    counts = {0: 50, 1: 25, 2: 10, 3: 10, 4: 3, 5: 2}
    assert class_groups(counts) == {"head": [0, 1], "mid": [2, 3], "tail": [4, 5]}


def test_long_tailed_scenario_one_task_dirichlet_participation_and_groups_saved(tmp_path) -> None:
    train = np.repeat(np.arange(10), 100)
    test = np.repeat(np.arange(10), 10)
    cfg = ScenarioConfig(
        kind="long_tailed",
        num_tasks=1,
        num_clients=20,
        rounds_per_task=5,
        long_tail={"imbalance_factor": 100},
        partition={"kind": "dirichlet", "beta": 0.1, "min_samples": 0},
        participation={"fraction": 0.4, "mode": "per_round"},
    )
    sc = build_long_tailed(cfg, train, test, 10, seed=3)
    assert sc.num_tasks == 1 and sc.task_classes == [list(range(10))]
    kept = np.concatenate(sc.client_train[0])
    assert len(kept) == len(set(kept.tolist()))  # every kept image goes to exactly one client
    assert np.bincount(train[kept], minlength=10).tolist() == long_tail_counts(100, 10, 100)
    assert all(len(r) == 8 for r in sc.participants[0]) and len({tuple(r) for r in sc.participants[0]}) > 1
    per_client = sc.client_class_counts(train)
    assert (per_client == 0).mean() > 0.3  # α = 0.1: strongly non-IID
    assert len(sc.test_indices[0]) == 100  # the balanced test split
    assert sc.class_groups["head"][0] == 0 and 9 in sc.class_groups["tail"]
    sc.save(tmp_path / "s.json", train)
    assert Scenario.load(tmp_path / "s.json").class_groups == sc.class_groups


def test_class_group_accuracy_hand_example() -> None:
    correct = {0: 9, 1: 8, 2: 5, 3: 1}
    total = {0: 10, 1: 10, 2: 10, 3: 10}
    acc = class_group_accuracy(correct, total, {"head": [0, 1], "mid": [2], "tail": [3]})
    assert acc == pytest.approx({"overall": 57.5, "head": 85.0, "mid": 50.0, "tail": 10.0})


def test_long_tailed_needs_one_task() -> None:
    raw = tiny_raw(scenario={"kind": "long_tailed", "num_tasks": 2})
    with pytest.raises(ConfigError, match="num_tasks: 1"):
        build_config(raw)


LT_COUNTS = [12, 7, 4, 2, 1, 1]  # a tiny ImageNet-LT: its own long tail, IF 12


def _imagenet_lt_config(root: Path, **long_tail: object):
    raw = tiny_raw(
        scenario={
            "kind": "long_tailed",
            "num_tasks": 1,
            "num_clients": 3,
            "long_tail": long_tail,
            "partition": {"kind": "dirichlet", "beta": 0.5, "min_samples": 0},
        }
    )
    raw["data"] = {"name": "imagenet_lt", "root": str(root), "options": {"decode_size": 4}}
    return build_config(raw)


def _tiny_imagenet_lt(tmp_path: Path) -> Path:
    """ImageNet-LT's layout and split files, classes with LT_COUNTS training images and 2 test images each."""
    root = tmp_path / "imagenet"
    wnids = [f"n0{1440764 + c}" for c in range(len(LT_COUNTS))]
    train = [(f"train/{w}/{w}_{k}.JPEG", c) for c, w in enumerate(wnids) for k in range(LT_COUNTS[c])]
    test = [(f"val/{w}/ILSVRC2012_val_{c:03d}{k}.JPEG", c) for c, w in enumerate(wnids) for k in range(2)]
    for i, (rel, _) in enumerate(train + test):
        _write_image(root / rel, i)
    for name, rows in [("train", train), ("test", test)]:
        (root / f"ImageNet_LT_{name}.txt").write_text("".join(f"{r} {c}\n" for r, c in rows))
    return root


def test_dataset_profile_keeps_imagenet_lt_class_counts(tmp_path: Path) -> None:
    root = _tiny_imagenet_lt(tmp_path)
    rt = Runtime.build(_imagenet_lt_config(root, profile="dataset"))
    train = rt.dataset.train.targets.numpy()
    kept = np.concatenate(rt.scenario.client_train[0])
    assert sorted(kept.tolist()) == list(range(len(train)))  # every training image, each at exactly one client
    assert np.bincount(train[kept]).tolist() == LT_COUNTS
    # shares before each class: 0, .44, .70, .85, .93, .96 → head, head, head, mid, mid, tail
    assert rt.scenario.class_groups == {"head": [0, 1, 2], "mid": [3, 4], "tail": [5]}
    assert len(rt.scenario.test_indices[0]) == 12
    # the default exponential profile re-subsamples from the smallest class instead (n_max = 1 here)
    exp = Runtime.build(_imagenet_lt_config(root))
    assert np.bincount(train[np.concatenate(exp.scenario.client_train[0])]).tolist() == [1] * 6


def test_dataset_profile_is_refused_where_it_means_nothing(tmp_path: Path) -> None:
    lt = {"kind": "long_tailed", "num_tasks": 1, "long_tail": {"profile": "dataset"}}
    with pytest.raises(ConfigError, match=r"synthetic's training split is not long-tailed; use profile: exponential"):
        check_config(build_config(tiny_raw(scenario=lt)))
    with pytest.raises(ConfigError, match="drop imbalance_factor"):
        build_config(tiny_raw(scenario={**lt, "long_tail": {"profile": "dataset", "imbalance_factor": 50}}))
    with pytest.raises(ConfigError, match="applies to scenario.kind: long_tailed, not class_incremental"):
        build_config(tiny_raw(scenario={"long_tail": {"profile": "dataset"}}))
    cfg = ScenarioConfig(kind="long_tailed", num_tasks=1, num_clients=2, long_tail={"profile": "dataset"})
    with pytest.raises(PartitionError, match="every class has 5 images: there is no long tail to keep"):
        build_long_tailed(cfg, np.repeat(np.arange(4), 5), np.arange(4), 4, seed=0)
