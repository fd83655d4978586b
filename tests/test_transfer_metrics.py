"""Powder's transfer metrics against hand-computed values, and the asynchronous scheduler's defining properties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from promptfcl.config import ScenarioConfig
from promptfcl.evaluation.transfer import (
    bwt_per_stage,
    forgetting_per_stage,
    fwt_per_stage,
    transfer_summary,
)
from promptfcl.scenario import Scenario, build_scenario
from promptfcl.scenario.partition import PartitionError

# three stage ends; tasks 0 and 1 start at stage 0, task 1 finishes at 0, task 0 at 1, task 2 starts at 1 and
# finishes at 2 (the run ends)
POINTS = [{0: 50.0, 1: 60.0}, {0: 70.0, 1: 40.0, 2: 30.0}, {0: 65.0, 1: 45.0, 2: 50.0}]
FINISHED = [[1], [0], [2]]
DIRECT = [{0: 40.0, 1: 70.0}, {0: 60.0, 1: 0.0, 2: 20.0}, {0: 0.0, 1: 0.0, 2: 55.0}]


def test_transfer_metrics_equal_hand_computed_values() -> None:
    # forgetting: stage 0 all new → 0; stage 1: task0 50−70=−20, task1 60−40=20, task2 new 0 → 0; stage 2: task0
    # max(50,70)−65=5, task1 60−45=15, task2 30−50=−20 → 0
    assert forgetting_per_stage(POINTS) == [0.0, 0.0, 0.0]
    # BWT: stage 0 none finished before → NaN; stage 1: task1 40−60=−20; stage 2: task1 45−60=−15, task0 65−70=−5
    bwt = bwt_per_stage(POINTS, FINISHED)
    assert math.isnan(bwt[0]) and bwt[1:] == [-20.0, -10.0]
    # FWT: stage 0 task1 60−70=−10; stage 1 task0 70−60=10; stage 2 task2 50−55=−5
    assert fwt_per_stage(POINTS, DIRECT, FINISHED) == [-10.0, 10.0, -5.0]
    s = transfer_summary(POINTS, FINISHED, DIRECT, correct=160, total=300)
    assert s["acc"] == pytest.approx((55.0 + 140 / 3 + 160 / 3) / 3)
    assert s["faa"] == pytest.approx(160 / 3) and s["sample_weighted_accuracy"] == pytest.approx(160 / 3)
    assert s["bwt"] == pytest.approx(-15.0) and s["fwt"] == pytest.approx(-5 / 3)
    assert s["total_transfer"] == pytest.approx((-10 + 10 - 5 - 20 - 10) / 3)  # (ΣFWT_s + ΣBWT_s) / S
    assert s["average_forgetting"] == 0.0 and s["aia"] == s["acc"]
    # AIA averages every evaluated round: a mid-stage point lowers it below Acc
    every = [{0: 10.0, 1: 20.0}, POINTS[0], POINTS[1], POINTS[2]]
    assert transfer_summary(POINTS, FINISHED, all_points=every)["aia"] == pytest.approx((15.0 + 3 * s["acc"]) / 4)
    assert math.isnan(transfer_summary(POINTS, FINISHED)["fwt"])


def test_forgetting_uses_the_best_earlier_accuracy() -> None:
    pts = [{0: 80.0}, {0: 90.0, 1: 10.0}, {0: 60.0, 1: 5.0}]
    assert forgetting_per_stage(pts) == [0.0, pytest.approx(-5.0), pytest.approx((30.0 + 5.0) / 2)]


def async_scenario(clients: int = 5, tasks: int = 6, seed: int = 0, **kw) -> Scenario:
    cfg = ScenarioConfig(
        kind="asynchronous", num_tasks=tasks, num_clients=clients, classes_per_task=10, rounds_per_task=3, **kw
    )
    y = np.repeat(np.arange(100), 50)
    return build_scenario(cfg, y, np.repeat(np.arange(100), 10), 100, seed)


@pytest.mark.parametrize("clients", [3, 5, 6])
def test_scheduler_switches_exactly_half_the_clients_per_stage(clients: int) -> None:
    s = async_scenario(clients)
    assert s.schedule is not None and s.owners is not None
    assert [s.owners[g][1] for g in s.schedule[0]] == [0] * clients  # everyone starts with its task 0
    for stage in range(1, s.num_tasks):
        prev, cur = s.schedule[stage - 1], s.schedule[stage]
        switched = [k for k in range(clients) if cur[k] != prev[k]]
        assert len(switched) == clients // 2
        assert all(s.owners[cur[k]] == (k, stage) for k in switched)  # a switch jumps to task `stage` (skips)
        assert all(s.owners[g][0] == k for k, g in enumerate(cur))
    # each client skipped some tasks over the run, and the timeline differs across seeds
    assert any(len({g for row in s.schedule for g in [row[k]]}) < s.num_tasks for k in range(clients))
    assert async_scenario(clients, seed=1).schedule != s.schedule


def test_async_scenario_slots_overlap_slices_and_roundtrip(tmp_path) -> None:
    s = async_scenario()
    space = s.label_space
    assert space.num_logits == 5 * 6 * 10 and space.repeats  # every (client, task) owns 10 slots; classes recur
    seen: dict[int, list[int]] = {}
    for g, t in enumerate(space.tasks):
        for c in t.classes:
            seen.setdefault(c, []).append(g)
        assert (space.task_class_to_logit(g)[list(t.classes)] == torch_tensor(t.logits)).all()
    y = np.repeat(np.arange(100), 50)
    for stage, row in enumerate(s.schedule):
        for k, g in enumerate(row):
            idx = s.client_train[stage][k]
            assert set(np.unique(y[idx]).tolist()) == set(s.task_classes[g])
            assert len(idx) == 10 * 10  # a 1/5 slice of 50 images for each of 10 classes
    with pytest.raises(ValueError, match="task_class_to_logit"):
        _ = space.class_to_logit
    s.save(tmp_path / "scenario.json", y)
    s2 = Scenario.load(tmp_path / "scenario.json")
    assert s2.schedule == s.schedule and s2.owners == s.owners and s2.task_classes == s.task_classes
    assert s2.finished_label_tasks(0) == s.finished_label_tasks(0)
    with pytest.raises(PartitionError, match="classes_per_task"):
        build_scenario(ScenarioConfig(kind="asynchronous", num_tasks=2, classes_per_task=[2, 2]), y, y, 100, 0)


def trained_images(s: Scenario, y: np.ndarray) -> dict[tuple[int, int], frozenset[int]]:
    """(label-space task, real class) → the training image indices it is trained on (scheduled tasks only)."""
    out: dict[tuple[int, int], frozenset[int]] = {}
    for stage, row in enumerate(s.schedule or []):
        for k, g in enumerate(row):
            idx = s.client_train[stage][k]
            for c in s.task_classes[g]:
                out[g, c] = frozenset(idx[y[idx] == c].tolist())
    return out


@pytest.mark.parametrize("rule", ["powder", "distinct"])
def test_slice_rule_powder_repeats_images_at_the_same_position_distinct_never(rule: str) -> None:
    """Powder's rule: slice (k·T + j) mod 5 = j when T = 5, so a class repeated at the same position j of two
    clients' sequences is trained on the same images (repeats at other positions on disjoint ones). `distinct`:
    every repeat of a class gets a slice no earlier occurrence had, so repeats never share an image."""
    s = async_scenario(tasks=5, asynchronous={"min_overlap": 5, "slice_rule": rule})
    y = np.repeat(np.arange(100), 50)
    images = trained_images(s, y)
    occurrences: dict[int, int] = {}
    for t in s.task_classes:
        for c in t:
            occurrences[c] = occurrences.get(c, 0) + 1
    same_position, other_position = [], []
    for (g1, c1), a in images.items():
        for (g2, c2), b in images.items():
            if c1 != c2 or g1 >= g2 or occurrences[c1] > 5:
                continue
            assert len(a) == len(b) == 10  # a 1/5 slice of 50 images
            (same_position if s.owners[g1][1] == s.owners[g2][1] else other_position).append(a == b)
            assert a == b or not (a & b)  # slices of one permutation: equal or disjoint
    assert same_position and other_position  # the scenario has both kinds of repeats
    assert not any(other_position)
    if rule == "powder":
        assert all(same_position)
    else:
        assert not any(same_position)


def torch_tensor(x):  # noqa: ANN001, ANN201
    import torch

    return torch.tensor(x)


def test_study_table_shows_transfer_metrics_against_the_direct_cell(tmp_path) -> None:
    import json

    from promptfcl.study import StudyConfig, summarize_study

    s = async_scenario(clients=2, tasks=3)
    for cell, bonus in (("direct", 0.0), ("c2p", 7.0)):
        log = [
            {"stage": st, "round": 2, "stage_end": True, "label_task": g, "accuracy": 50.0 + bonus + st,
             "correct": 1, "total": 2}
            for st in range(3)
            for g in s.trained_label_tasks(st)
        ]  # fmt: skip
        d = tmp_path / cell / "seed0"
        d.mkdir(parents=True)
        s.save(d / "scenario.json")
        summary = {"faa": 1.0, "average_forgetting": 0.0, "bwt": 0.0}  # recomputed from the log
        metrics = {"method": cell, "seed": 0, "summary": summary, "evaluations": log, "timing": {}}
        (d / "metrics.json").write_text(json.dumps(metrics))
    plan = {"study": "t", "seeds": [0], "cells": [{"name": "direct"}, {"name": "c2p"}], "direct_cell": "direct"}
    (tmp_path / "study.json").write_text(json.dumps(plan))
    study = StudyConfig(name="t", base="b.yaml", cells={"direct": {}, "c2p": {}}, direct_cell="direct")
    table = summarize_study(study, tmp_path)
    header, _, direct_row, c2p_row = table.splitlines()
    cols = [c.strip() for c in header.strip("|").split("|")]
    vals = dict(zip(cols, [c.strip() for c in c2p_row.strip("|").split("|")], strict=True))
    assert vals["acc"] == "58.00" and vals["fwt"] == "7.00"  # Acc from the log; FWT = +7 at every stage
    assert dict(zip(cols, [c.strip() for c in direct_row.strip("|").split("|")], strict=True))["fwt"] == "–"
    with pytest.raises(ValueError, match="direct_cell"):
        StudyConfig(name="t", base="b.yaml", cells={"c2p": {}}, direct_cell="direct")


def test_async_eval_problems_are_reported_before_training(tmp_path) -> None:
    from promptfcl.config import ConfigError
    from promptfcl.runtime import check_config

    from .conftest import tiny_config

    scen = {"kind": "asynchronous", "num_tasks": 2, "num_clients": 2, "classes_per_task": 2}
    with pytest.raises(ConfigError, match="task_agnostic is undefined"):
        check_config(tiny_config(scenario=scen, eval={"regime": "task_agnostic"}))
    with pytest.raises(ConfigError, match="direct_reference"):
        check_config(tiny_config(scenario=scen, eval={"direct_reference": str(tmp_path / "none")}))
