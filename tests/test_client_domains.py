"""Per-client image domains (`scenario.domains`) and clients that never share a training image
(`slice_rule: disjoint`): the scenario C2Prompt's LCDC has something to fix in."""

from __future__ import annotations

import numpy as np
import pytest

from promptfcl.config import ScenarioConfig
from promptfcl.scenario.partition import PartitionError
from promptfcl.scenario.scenario import Scenario, build_scenario

CIFAR_LIKE = np.repeat(np.arange(100), 100)


def async_cfg(**asynchronous) -> ScenarioConfig:
    """The CPU C2Prompt scenario's shape: 5 clients × 5 tasks of 10 classes out of 100, 1/5 slices."""
    return ScenarioConfig(
        kind="asynchronous", num_tasks=5, classes_per_task=10, num_clients=5, rounds_per_task=3,
        asynchronous={"min_overlap": 0, "data_slices": 5, **asynchronous},
    )  # fmt: skip


def client_images(s: Scenario) -> list[set[int]]:
    """[client] → every training image it trains on over the run (its scheduled tasks)."""
    out: list[set[int]] = [set() for _ in range(s.num_clients)]
    for stage, row in enumerate(s.schedule or []):
        for k in range(len(row)):
            out[k] |= set(s.client_train[stage][k].tolist())
    return out


def images_shared_by_two_clients(s: Scenario) -> int:
    imgs = client_images(s)
    return sum(len(imgs[a] & imgs[b]) for a in range(len(imgs)) for b in range(a + 1, len(imgs)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distinct_slices_still_let_two_clients_share_images_disjoint_never(seed: int) -> None:
    """`distinct` cycles once a class occurs more than `data_slices` times (here up to 13), so a cycled slice can be
    another client's: images are shared. `disjoint` reuses only the client's own slices: none shared, and every
    class repeat still sees fresh images while the class has unused slices."""
    distinct = build_scenario(async_cfg(slice_rule="distinct"), CIFAR_LIKE, CIFAR_LIKE, 100, seed)
    assert images_shared_by_two_clients(distinct) > 0
    disjoint = build_scenario(async_cfg(slice_rule="disjoint"), CIFAR_LIKE, CIFAR_LIKE, 100, seed)
    assert disjoint.task_classes == distinct.task_classes and disjoint.schedule == distinct.schedule
    assert images_shared_by_two_clients(disjoint) == 0
    # each (client, task) still holds 1/5 of every class of the task: 20 of 100 images per class
    for stage, row in enumerate(disjoint.schedule or []):
        for k, g in enumerate(row):
            idx = disjoint.client_train[stage][k]
            counts = np.bincount(CIFAR_LIKE[idx], minlength=100)
            assert sorted(np.flatnonzero(counts).tolist()) == sorted(disjoint.task_classes[g])
            assert set(counts[counts > 0].tolist()) == {20}
    # a class occurring at most data_slices times gets the same (all fresh) slices under both rules
    occurrences: dict[int, int] = {}
    for t in distinct.task_classes:
        for c in t:
            occurrences[c] = occurrences.get(c, 0) + 1
    compared = 0
    for stage, row in enumerate(distinct.schedule or []):
        for k in range(len(row)):
            a, b = distinct.client_train[stage][k], disjoint.client_train[stage][k]
            for c in set(CIFAR_LIKE[a].tolist()):
                if occurrences[c] <= 5:
                    assert set(a[CIFAR_LIKE[a] == c].tolist()) == set(b[CIFAR_LIKE[b] == c].tolist())
                    compared += 1
    assert compared > 10


def test_disjoint_refuses_more_clients_per_class_than_slices() -> None:
    cfg = ScenarioConfig(
        kind="asynchronous", num_tasks=2, classes_per_task=10, num_clients=6, rounds_per_task=1,
        asynchronous={"min_overlap": 10, "data_slices": 2, "slice_rule": "disjoint"},
    )  # fmt: skip
    with pytest.raises(PartitionError, match="raise scenario.asynchronous.data_slices"):
        build_scenario(cfg, CIFAR_LIKE, CIFAR_LIKE, 100, 0)
