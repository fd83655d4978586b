"""Upper-bound rows (`scenario.upper_bound`): the centralized learner holds exactly the federated clients' data of
each task, the joint learner every class's images in one task, and runs, reports and studies label them."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml

from promptfcl.config import ConfigError, ScenarioConfig, build_config
from promptfcl.experiment import Experiment
from promptfcl.runtime import check_config
from promptfcl.scenario import Scenario, build_scenario

from .conftest import tiny_raw

TRAIN = np.repeat(np.arange(6), 40)  # 6 classes x 40 train images, as the tiny synthetic dataset
TEST = np.repeat(np.arange(6), 8)


def scenarios(**scenario: object) -> tuple[Scenario, Scenario, Scenario]:
    """The federated scenario and its centralized and joint forms, same config and seed."""
    base = {"num_tasks": 3, "num_clients": 4, "rounds_per_task": 2, "class_order": "shuffled", **scenario}
    out = []
    for bound in (None, "centralized", "joint"):
        cfg = ScenarioConfig.model_validate({**base, "upper_bound": bound})
        out.append(build_scenario(cfg, TRAIN, TEST, 6, seed=3))
    return out[0], out[1], out[2]


def test_centralized_learner_holds_exactly_the_union_of_the_clients_train_indices_of_each_task(tmp_path) -> None:
    fed, cen, _ = scenarios(participation={"fraction": 0.5, "mode": "per_round"})
    assert cen.num_clients == 1 and cen.upper_bound == "centralized"
    assert cen.class_order == fed.class_order and cen.task_classes == fed.task_classes
    assert all(np.array_equal(a, b) for a, b in zip(cen.test_indices, fed.test_indices, strict=True))
    assert cen.participants == [[[0], [0]]] * 3  # same rounds per task, one learner (participation ignored)
    for t in range(3):
        union = np.unique(np.concatenate(fed.client_train[t]))
        assert len(cen.client_train[t]) == 1 and np.array_equal(cen.client_train[t][0], union)
        assert np.array_equal(union, np.flatnonzero(np.isin(TRAIN, fed.task_classes[t])))  # the task's whole set
    cen.save(tmp_path / "scenario.json")  # what --resume reloads
    back = Scenario.load(tmp_path / "scenario.json")
    assert back.upper_bound == "centralized" and back.participants == cen.participants


def test_centralized_hepco_rounds_see_exactly_that_rounds_stateless_draws() -> None:
    fed, cen, joint = scenarios(partition={"kind": "hepco", "category_ratio": 0.5, "split_ratio": 0.2})
    assert cen.num_clients == 2 and cen.participants == [[[0], [1]]] * 3  # learner r trains round r
    for t in range(3):
        for r in range(2):
            drawn = np.unique(np.concatenate([fed.client_train[t][k] for k in fed.participants[t][r]]))
            assert np.array_equal(cen.client_train[t][r], drawn)
    for r in range(2):  # joint: round r holds round r's draws of every task
        drawn = np.unique(np.concatenate([fed.client_train[t][k] for t in range(3) for k in fed.participants[t][r]]))
        assert np.array_equal(joint.client_train[0][r], drawn)


def test_joint_learner_holds_every_classs_train_images_in_one_task_with_the_federated_logits() -> None:
    fed, _, joint = scenarios()
    assert joint.num_tasks == 1 and joint.rounds_per_task == fed.rounds_per_task and joint.num_clients == 1
    assert joint.task_classes == [[c for task in fed.task_classes for c in task]]
    assert np.array_equal(joint.client_train[0][0], np.arange(len(TRAIN)))  # every class's every train image
    assert np.array_equal(joint.test_indices[0], np.arange(len(TEST)))
    assert joint.label_space.num_tasks == 1
    assert joint.label_space.class_to_logit.tolist() == fed.label_space.class_to_logit.tolist()


@pytest.mark.parametrize(
    ("updates", "match"),
    [
        ({"scenario": {"kind": "personalized", "num_tasks": 1}}, "not on personalized"),
        ({"scenario": {"kind": "asynchronous", "classes_per_task": 2}}, "not on asynchronous"),
        ({"engine": {"device": "cpu", "faults": [{"kind": "raise", "client": 0}]}}, "remove engine.faults"),
        ({"engine": {"device": "cpu", "min_clients": 2}}, "set engine.min_clients: 1"),
    ],
)
def test_upper_bounds_refuse_combinations_they_are_not_defined_on(updates: dict, match: str) -> None:
    raw = tiny_raw(**updates)
    raw["scenario"]["upper_bound"] = "centralized"
    with pytest.raises(ConfigError, match=match):
        check_config(build_config(raw))


def test_upper_bound_runs_and_a_study_cell_are_labelled_in_metrics_report_and_summary(tmp_path) -> None:
    from promptfcl.report.comparison import write_report
    from promptfcl.study import load_study, plan, summarize_study

    base = tiny_raw(scenario={"rounds_per_task": 1}, method={"local_epochs": 1})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    study = {
        "name": "ub",
        "base": "base.yaml",
        "seeds": [0],
        "cells": {
            "fedavg_prompt": {},
            "centralized": {"set": ["scenario.upper_bound=centralized"]},
            "joint": {"set": ["scenario.upper_bound=joint"]},
        },
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study, sort_keys=False))
    out = tmp_path / "out"
    runs = plan(*load_study(tmp_path / "study.yaml"), out)
    metrics = {
        r.cell: Experiment(build_config(yaml.safe_load(r.config_path.read_text())), r.run_dir, False).run()
        for r in runs
    }
    cen, joint = metrics["centralized"], metrics["joint"]
    assert "upper_bound" not in metrics["fedavg_prompt"]
    assert cen["upper_bound"] == "centralized" and len(cen["accuracy_matrix"]) == 2  # task by task
    assert joint["upper_bound"] == "joint" and joint["accuracy_matrix"] == [[joint["summary"]["faa"]]]
    rounds = [json.loads(x) for x in (out / "joint" / "seed0" / "rounds.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in rounds] == [[0]]  # one task, one round, one learner
    assert "| upper bound | centralized |" in (out / "centralized" / "seed0" / "report.md").read_text()

    summarize_study(load_study(tmp_path / "study.yaml")[0], out)
    table = (out / "summary.md").read_text()
    # the random test backbone fails the validity gate, so every label also carries the invalid flag
    assert "| centralized [upper bound: centralized] ⚠ INVALID | fedavg_prompt | 1 |" in table
    assert "| joint [upper bound: joint] ⚠ INVALID | fedavg_prompt | 1 |" in table
    assert "| fedavg_prompt ⚠ INVALID | fedavg_prompt |" in table
    rows = {r["cell"]: r for r in csv.DictReader((out / "summary.csv").open())}
    assert rows["joint"]["upper_bound"] == "joint" and rows["fedavg_prompt"]["upper_bound"] == ""
    from promptfcl.report.collect import groups_from_study

    report = write_report(groups_from_study(out), out, "ub").read_text()
    assert "centralized [upper bound: centralized]" in report and "**Upper bounds**" in report
    assert "UPPER BOUND (joint): one task of the classes of 2 tasks, one learner holding the data of 3" in report
