"""What every scenario family draws the same way: classes per task, the class order and each round's participants."""

from __future__ import annotations

import math

from promptfcl.config import ScenarioConfig
from promptfcl.scenario.partition import PartitionError
from promptfcl.seeding import numpy_rng


def task_class_counts(cfg: ScenarioConfig, num_classes: int) -> list[int]:
    """Classes in each task, checked against the dataset's class count."""
    cpt = cfg.classes_per_task
    if cfg.kind == "asynchronous":
        if not isinstance(cpt, int) or cpt > num_classes:
            raise PartitionError(
                "an asynchronous scenario needs scenario.classes_per_task as one integer ≤ the dataset's "
                f"{num_classes} classes"
            )
        return [cpt] * cfg.num_tasks
    if cpt is None:
        if num_classes % cfg.num_tasks:
            raise PartitionError(
                f"{num_classes} classes do not split evenly into {cfg.num_tasks} tasks; set scenario.classes_per_task"
            )
        counts = [num_classes // cfg.num_tasks] * cfg.num_tasks
    elif isinstance(cpt, int):
        counts = [cpt] * cfg.num_tasks
    else:
        counts = list(cpt)
        if len(counts) != cfg.num_tasks:
            raise PartitionError(
                f"scenario.classes_per_task lists {len(counts)} tasks but num_tasks is {cfg.num_tasks}; give one "
                "count per task or set scenario.num_tasks to the list's length"
            )
    if sum(counts) > num_classes:
        raise PartitionError(
            f"tasks need {sum(counts)} classes but the dataset has {num_classes}; lower "
            "scenario.num_tasks or scenario.classes_per_task"
        )
    return counts


def class_order(cfg: ScenarioConfig, num_classes: int, seed: int) -> list[int]:
    if isinstance(cfg.class_order, list):
        order = list(cfg.class_order)
        if sorted(order) != sorted(set(order)) or any(not 0 <= c < num_classes for c in order):
            raise PartitionError(
                f"scenario.class_order must list distinct class ids in [0, {num_classes}); remove duplicates and "
                "out-of-range ids"
            )
        return order
    if cfg.class_order == "shuffled":
        return numpy_rng(seed, "class_order").permutation(num_classes).tolist()
    return list(range(num_classes))


def draw_participants(cfg: ScenarioConfig, seed: int) -> list[list[list[int]]]:
    m = cfg.num_clients
    k = max(1, math.ceil(cfg.participation.fraction * m))
    out = []
    for t in range(cfg.num_tasks):
        if cfg.participation.mode == "per_task":
            chosen = sorted(numpy_rng(seed, "participants", t).choice(m, size=k, replace=False).tolist())
            out.append([chosen] * cfg.rounds_per_task)
        else:
            out.append(
                [
                    sorted(numpy_rng(seed, "participants", t, r).choice(m, size=k, replace=False).tolist())
                    for r in range(cfg.rounds_per_task)
                ]
            )
    return out


def client_slots(cfg: ScenarioConfig) -> int:
    """Client ids a scenario uses: `num_clients`, or one fresh client per (round, slot) of a task when the
    partition draws new stateless clients every round (`partition.kind: hepco`)."""
    return cfg.num_clients * cfg.rounds_per_task if cfg.partition.kind == "hepco" else cfg.num_clients
