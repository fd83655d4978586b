"""The class-incremental family: disjoint class sets per task, each task's samples split over the clients (Dirichlet,
IID, or HePCo's fresh clients per round)."""

from __future__ import annotations

import numpy as np

from promptfcl.config import ScenarioConfig
from promptfcl.scenario.common import class_order, draw_participants, task_class_counts
from promptfcl.scenario.partition import dirichlet_partition, hepco_client_sample, iid_partition
from promptfcl.scenario.scenario import Scenario
from promptfcl.seeding import numpy_rng


def build_class_incremental(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    """Class-incremental scenario: disjoint class sets per task, each task's samples split over clients."""
    counts = task_class_counts(cfg, num_classes)
    order = class_order(cfg, num_classes, seed)
    tasks, offset = [], 0
    for n in counts:
        tasks.append(order[offset : offset + n])
        offset += n
    if cfg.partition.kind == "hepco":
        return _stateless_rounds(cfg, train_targets, test_targets, num_classes, seed, order[:offset], tasks)
    client_train, test_idx = [], []
    for t, classes in enumerate(tasks):
        pos = np.flatnonzero(np.isin(train_targets, classes))
        rng = numpy_rng(seed, "partition", t)
        if cfg.partition.kind == "dirichlet":
            parts = dirichlet_partition(
                train_targets[pos],
                cfg.num_clients,
                cfg.partition.beta,
                rng,
                cfg.partition.min_samples,
                cfg.partition.max_retries,
            )
        else:
            parts = iid_partition(train_targets[pos], cfg.num_clients, rng, cfg.partition.min_samples)
        client_train.append([pos[p] for p in parts])
        test_idx.append(np.flatnonzero(np.isin(test_targets, classes)))
    return Scenario(
        seed, num_classes, order[:offset], tasks, client_train, test_idx, draw_participants(cfg, seed), cfg.num_clients
    )


def _stateless_rounds(
    cfg: ScenarioConfig,
    train_targets: np.ndarray,
    test_targets: np.ndarray,
    num_classes: int,
    seed: int,
    order: list[int],
    tasks: list[list[int]],
) -> Scenario:
    """HePCo: `num_clients` fresh clients per round; client slot r·K + k is round r's k-th client of every task."""
    k, rounds = cfg.num_clients, cfg.rounds_per_task
    p = cfg.partition
    client_train, test_idx = [], []
    for t, classes in enumerate(tasks):
        pos = np.flatnonzero(np.isin(train_targets, classes))
        client_train.append(
            [
                pos[
                    hepco_client_sample(
                        train_targets[pos],
                        numpy_rng(seed, "hepco", t, slot),
                        p.category_ratio,
                        p.split_ratio,
                        p.imbalance if p.apply_imbalance else 1.0,  # false: the official code's data (β unused)
                    )
                ]
                for slot in range(rounds * k)
            ]
        )
        test_idx.append(np.flatnonzero(np.isin(test_targets, classes)))
    participants = [[list(range(r * k, (r + 1) * k)) for r in range(rounds)] for _ in tasks]
    return Scenario(seed, num_classes, order, tasks, client_train, test_idx, participants, rounds * k)
