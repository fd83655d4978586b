"""Partition properties, scenario determinism and persistence, label-space masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from promptfcl.config import ScenarioConfig
from promptfcl.scenario import LabelSpace, PartitionError, Scenario, build_class_incremental, dirichlet_partition


def labels(classes: int = 10, per_class: int = 100) -> np.ndarray:
    return np.repeat(np.arange(classes), per_class)


def test_every_sample_assigned_exactly_once_and_min_samples_hold() -> None:
    y = labels()
    parts = dirichlet_partition(y, 8, 0.3, np.random.default_rng(0), min_samples=20)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(y) and len(np.unique(allidx)) == len(y)
    assert min(len(p) for p in parts) >= 20


def mean_label_entropy(beta: float, seeds: int = 5) -> float:
    y = labels()
    ent = []
    for s in range(seeds):
        for p in dirichlet_partition(y, 10, beta, np.random.default_rng(s)):
            if len(p):
                q = np.bincount(y[p], minlength=10) / len(p)
                q = q[q > 0]
                ent.append(-(q * np.log(q)).sum())
    return float(np.mean(ent))


def test_label_skew_grows_as_beta_falls() -> None:
    e = [mean_label_entropy(b) for b in (100.0, 1.0, 0.1, 0.01)]
    assert all(a > b for a, b in zip(e, e[1:], strict=False)), e
    assert e[0] > 0.95 * np.log(10)  # near-uniform for large β


def test_partition_reproducible_with_seed() -> None:
    y = labels()
    a = dirichlet_partition(y, 5, 0.5, np.random.default_rng(7))
    b = dirichlet_partition(y, 5, 0.5, np.random.default_rng(7))
    c = dirichlet_partition(y, 5, 0.5, np.random.default_rng(8))
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c, strict=True))


def test_impossible_partitions_are_explained() -> None:
    with pytest.raises(PartitionError, match="min_samples"):
        dirichlet_partition(labels(2, 5), 4, 0.5, np.random.default_rng(0), min_samples=5)
    with pytest.raises(PartitionError, match="raise scenario.partition.beta"):
        dirichlet_partition(labels(2, 50), 10, 0.01, np.random.default_rng(0), min_samples=9, max_retries=20)


def make(cfg: ScenarioConfig, seed: int = 0) -> Scenario:
    y_train, y_test = labels(10, 40), labels(10, 10)
    return build_class_incremental(cfg, y_train, y_test, 10, seed)


def test_class_incremental_scenario_structure_and_roundtrip(tmp_path) -> None:
    cfg = ScenarioConfig(
        num_tasks=5,
        num_clients=4,
        rounds_per_task=3,
        class_order="shuffled",
        participation={"fraction": 0.5, "mode": "per_round"},
    )
    s = make(cfg)
    flat = [c for t in s.task_classes for c in t]
    assert sorted(flat) == list(range(10)) and flat == s.class_order
    y_train = labels(10, 40)
    for t, classes in enumerate(s.task_classes):
        idx = np.concatenate(s.client_train[t])
        assert sorted(idx.tolist()) == np.flatnonzero(np.isin(y_train, classes)).tolist()  # each sample once
    assert all(len(p) == 2 for task in s.participants for p in task)
    assert s.participants[0][0] != s.participants[0][1] or s.participants[0][1] != s.participants[0][2]
    path = tmp_path / "scenario.json"
    s.save(path, y_train)
    s2 = Scenario.load(path)
    assert s2.task_classes == s.task_classes and s2.participants == s.participants
    assert all(
        np.array_equal(a, b)
        for t, u in zip(s.client_train, s2.client_train, strict=True)
        for a, b in zip(t, u, strict=True)
    )
    assert s.client_class_counts(y_train).sum() == len(y_train)


def test_scenario_deterministic_from_seed() -> None:
    cfg = ScenarioConfig(num_tasks=2, num_clients=3, class_order="shuffled", partition={"beta": 0.3, "min_samples": 1})
    a, b, c = make(cfg, 1), make(cfg, 1), make(cfg, 2)
    assert a.to_json() == b.to_json()
    assert a.to_json() != c.to_json()


def test_per_task_participation_is_fixed_within_a_task() -> None:
    s = make(ScenarioConfig(num_tasks=2, num_clients=6, rounds_per_task=4, participation={"fraction": 0.5}))
    for task in s.participants:
        assert all(p == task[0] for p in task) and len(task[0]) == 3


def test_label_space_masks() -> None:
    space = LabelSpace([[7, 3], [1, 0, 9]], num_real_classes=10)
    assert space.num_logits == 5
    assert space.to_logits(torch.tensor([7, 3, 1, 9])).tolist() == [0, 1, 2, 4]
    assert space.train_mask(1, "current_task").tolist() == [False, False, True, True, True]
    assert space.train_mask(0, "seen").tolist() == [True, True, False, False, False]
    assert space.eval_mask(0, 1).tolist() == [True] * 5  # task-agnostic: all seen logits compete
    assert space.eval_mask(0, 1, "task_aware").tolist() == [True, True, False, False, False]
    with pytest.raises(ValueError, match="no task"):
        space.to_logits(torch.tensor([5]))


@pytest.mark.parametrize("imbalance", [1.0, 0.1])
def test_hepco_clients_follow_kappa_gamma_and_the_applied_long_tail(imbalance: float) -> None:
    """Every round draws new clients: round(κ·k) classes, γ of each class's images, a β profile over them."""
    y_train, y_test = labels(20, 100), labels(20, 10)
    part = {"kind": "hepco", "category_ratio": 0.6, "split_ratio": 0.1, "imbalance": imbalance}
    cfg = ScenarioConfig(num_tasks=2, num_clients=5, rounds_per_task=3, partition=part)
    s = build_class_incremental(cfg, y_train, y_test, 20, seed=3)
    assert s.num_clients == 15 and s.participants[1] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    expected = sorted((math.ceil(10 * imbalance ** (j / 5)) for j in range(6)), reverse=True)
    class_sets = set()
    for t in range(2):
        for k in range(15):
            counts = np.unique(y_train[s.client_indices(t, k)], return_counts=True)
            assert set(counts[0]) <= set(s.task_classes[t])
            assert sorted(counts[1].tolist(), reverse=True) == expected  # 6 of 10 classes, 10 images at the head
            class_sets.add(tuple(counts[0]))
    assert len(class_sets) > 10  # clients differ
    again = build_class_incremental(cfg, y_train, y_test, 20, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(s.client_train[1], again.client_train[1], strict=True))


def test_hepco_apply_imbalance_false_is_the_official_codes_data() -> None:
    """`partition.apply_imbalance: false` (hepco-fed's data, whose β line is commented out): every kept class keeps
    its γ fraction whatever β is — the very partition of β = 1 — while true subsamples to the β profile."""
    y_train, y_test = labels(20, 100), labels(20, 10)

    def build(imbalance: float, apply: bool) -> Scenario:
        part = {"kind": "hepco", "split_ratio": 0.1, "imbalance": imbalance, "apply_imbalance": apply}
        cfg = ScenarioConfig(num_tasks=2, num_clients=5, rounds_per_task=2, partition=part)
        return build_class_incremental(cfg, y_train, y_test, 20, seed=1)

    code, paper, flat = build(0.05, False), build(0.05, True), build(1.0, True)
    for t in range(2):
        for k in range(10):
            assert np.array_equal(code.client_indices(t, k), flat.client_indices(t, k))
            counts = np.unique(y_train[code.client_indices(t, k)], return_counts=True)[1]
            assert counts.tolist() == [10] * 6  # γ = 0.1 of 100 images in each of the 6 kept classes
            tail = np.unique(y_train[paper.client_indices(t, k)], return_counts=True)[1]
            assert sorted(tail.tolist()) == sorted(math.ceil(10 * 0.05 ** (j / 5)) for j in range(6))
    assert ScenarioConfig().partition.apply_imbalance  # the paper's setting by default
