"""Long-tailed scenarios (IF subsampling → Dirichlet over clients, T = 1) and head/mid/tail evaluation."""

from __future__ import annotations

import numpy as np
import pytest

from promptfcl.config import ConfigError, ScenarioConfig, build_config
from promptfcl.evaluation.metrics import class_group_accuracy
from promptfcl.scenario.long_tail import build_long_tailed, class_groups, long_tail_counts
from promptfcl.scenario.scenario import Scenario

from .conftest import tiny_raw


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
