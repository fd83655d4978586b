"""Personalized scenarios (FedMGP §5.1.1), fixed-mapping label spaces, KR_t / KR_s and the client_local regime."""

from __future__ import annotations

import numpy as np
import pytest

from promptfcl.config import ScenarioConfig
from promptfcl.evaluation.client_local import ClientLocalRegime
from promptfcl.evaluation.metrics import spatial_retention, temporal_retention
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import Grid, RoundInfo
from promptfcl.scenario.label_space import LabelSpace
from promptfcl.scenario.partition import PartitionError
from promptfcl.scenario.personalized import build_personalized
from promptfcl.scenario.scenario import Scenario


def targets(classes: int, per_class: int) -> np.ndarray:
    return np.repeat(np.arange(classes), per_class)


def async_cfg(**kw) -> ScenarioConfig:
    base = {
        "kind": "personalized",
        "num_tasks": 2,
        "num_clients": 3,
        "class_order": "shuffled",
        "partition": {"min_samples": 0},
        "personalized": {"mode": "asynchronous", "private_classes": 2, "public_classes": 4},
    }
    base.update(kw)
    return ScenarioConfig.model_validate(base)


def test_asynchronous_private_classes_never_reach_another_client() -> None:
    train, test = targets(12, 20), targets(12, 5)
    sc = build_personalized(async_cfg(), train, test, 12, seed=3)
    m, T = 3, 2
    private = [set(sc.class_order[2 * k : 2 * k + 2]) for k in range(m)]
    public = set(sc.class_order[6:10])
    for k in range(m):
        mine = [set(c) for c in sc.client_tasks[k]]
        assert [len(c) for c in mine] == [3, 3] and set().union(*mine) == private[k] | public
        held = np.concatenate([np.concatenate([sc.client_train[t][k], sc.client_test[t][k]]) for t in range(T)])
        assert len(held) == len(set(held.tolist()))  # train and local test disjoint, no image twice
        for t in range(T):
            assert set(train[sc.client_train[t][k]]) | set(train[sc.client_test[t][k]]) <= mine[t]
            n = len(sc.client_train[t][k]) + len(sc.client_test[t][k])
            assert len(sc.client_train[t][k]) == int(0.7 * n)  # the official int(0.7·n) / rest split
        for other in set(range(m)) - {k}:  # nobody else ever sees client k's private classes
            other_held = np.concatenate([sc.client_train[t][other] for t in range(T)]
                                        + [sc.client_test[t][other] for t in range(T)])  # fmt: skip
            assert not set(train[other_held]) & private[k]
        assert (np.isin(train, list(private[k])).sum()) == np.isin(train[held], list(private[k])).sum()  # all of them
    every = np.concatenate([sc.client_train[t][k] for t in range(T) for k in range(m)]
                           + [sc.client_test[t][k] for t in range(T) for k in range(m)])  # fmt: skip
    assert len(every) == len(set(every.tolist()))  # public images are split, never duplicated
    assert set(train[every]) == private[0] | private[1] | private[2] | public
    assert Scenario.from_json(sc.to_json()).to_json() == sc.to_json()


def test_synchronous_tasks_are_shared_and_samples_split() -> None:
    cfg = async_cfg(personalized={"mode": "synchronous"}, classes_per_task=4)
    train = targets(8, 30)
    sc = build_personalized(cfg, train, targets(8, 5), 8, seed=0)
    assert all(sc.client_tasks[k] == sc.client_tasks[0] for k in range(3)) and len(sc.task_classes) == 2
    assert [sorted(c) for c in sc.client_tasks[0]] == sc.task_classes
    for t in range(2):
        parts = [np.concatenate([sc.client_train[t][k], sc.client_test[t][k]]) for k in range(3)]
        joined = np.concatenate(parts)
        assert len(joined) == len(set(joined.tolist())) == 4 * 30  # disjoint, complete
        assert set(train[joined]) == set(sc.task_classes[t])


def test_impossible_personalized_split_is_refused_with_the_fix() -> None:
    with pytest.raises(PartitionError, match="private_classes"):
        build_personalized(async_cfg(num_clients=5), targets(12, 4), targets(12, 1), 12, seed=0)


def test_fixed_label_space_lets_clients_order_classes_differently() -> None:
    space = LabelSpace([[0, 1, 2], [1, 2, 3]], 5, class_order=[3, 2, 1, 0])  # unions may overlap
    a, b = space.view([[0, 1], [2, 3]]), space.view([[3, 2], [1, 0]])
    assert a.class_to_logit.tolist() == b.class_to_logit.tolist() == [3, 2, 1, 0, -1]
    assert a.tasks[0].logits == (3, 2) and b.tasks[0].logits == (0, 1)
    assert a.seen_mask(1).all() and a.train_mask(1, "current_task").tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="seen_mask"):
        space.seen_logits(0)


def test_knowledge_retention_matches_hand_computed_values() -> None:
    # KR_t = 100 · mean(80/100, 45/90) = 65 ; KR_s = 100 · mean(60/80, 30/40) = 75; a zero denominator is skipped
    assert temporal_retention([80.0, 45.0], [100.0, 90.0]) == pytest.approx(65.0)
    assert spatial_retention([60.0, 30.0, 10.0], [80.0, 40.0, 0.0]) == pytest.approx(75.0)


class ScriptedGrid(Grid):
    """Answers `evaluate` messages with fixed counts per (round, client)."""

    def __init__(self, script: dict) -> None:
        super().__init__()
        self.script = script

    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        held, local = self.script[(self.round.stage, self.round.round)]
        return {
            c: Message(
                {},
                {"global": held[c], "local": {"task": self.round.stage, "round": self.round.round, "counts": local[c]}},
            )  # fmt: skip
            for c in messages
        }


class NoServer:
    def evaluate_message(self) -> Message:
        return Message({}, kind="evaluate")


def test_client_local_regime_computes_kr_per_round_from_the_definitions() -> None:
    sc = Scenario(0, 4, [0, 1, 2, 3], [[0, 1], [2, 3]], [], [], [[[0, 1]], [[0, 1]]], 2)
    # task 0 (last round): local task-0 accuracies 80% and 50% (the θ_i^0 reference), global 60% and 50%
    # task 1: local task-0 now 40% and 50%, local task-1 50% and 100%, global task-1 25% and 50%
    script = {
        (0, 0): ({0: {"0": [6, 10]}, 1: {"0": [1, 2]}}, {0: {"0": [8, 10]}, 1: {"0": [1, 2]}}),
        (1, 0): (
            {0: {"0": [5, 10], "1": [1, 4]}, 1: {"0": [2, 2], "1": [1, 2]}},
            {0: {"0": [4, 10], "1": [2, 4]}, 1: {"0": [1, 2], "1": [2, 2]}},
        ),
    }
    grid = ScriptedGrid(script)
    ev, state = ClientLocalRegime(sc, grid, 8, every_round=True), {}
    ev.init_state(state)
    assert ev.round_stamp(last=False) == {"measure_local": True}
    grid.start_round(RoundInfo(0, 0, (0, 1)))
    m = ev.evaluate(NoServer(), 0, 0, True, state)
    assert m["kr_t"] == pytest.approx(100.0) and m["kr_s"] == pytest.approx(100 * (0.6 / 0.8 + 0.5 / 0.5) / 2)
    assert m["accuracy"][0] == pytest.approx((60 + 50) / 2)  # mean over clients, not pooled counts
    grid.start_round(RoundInfo(1, 0, (0, 1)))
    m = ev.evaluate(NoServer(), 1, 0, True, state)
    assert m["kr_t"] == pytest.approx(100 * (0.4 / 0.8 + 0.5 / 0.5) / 2)  # 75
    assert m["kr_s"] == pytest.approx(100 * (0.25 / 0.5 + 0.5 / 1.0) / 2)  # 50
    assert m["accuracy"] == pytest.approx([(50 + 100) / 2, (25 + 50) / 2])
    out = ev.finish(state)
    assert out["summary"]["kr_t"] == pytest.approx(75.0) and out["summary"]["kr_s"] == pytest.approx(50.0)
    assert out["summary"]["task_accuracy"] == pytest.approx({"1": 75.0, "2": 37.5})
    assert out["summary"]["faa"] == pytest.approx((75.0 + 37.5) / 2) and len(out["retention"]["rounds"]) == 2


def test_fedmgp_presets_and_study_cells_describe_possible_personalized_scenarios(monkeypatch) -> None:
    from pathlib import Path

    from promptfcl.config import load_config
    from promptfcl.scenario.personalized import personalized_class_count
    from promptfcl.study import cell_config, load_study

    monkeypatch.setenv("PROMPTFCL_ASSETS", "/assets")
    root = Path(__file__).resolve().parents[1]
    configs = [load_config(p) for p in sorted(root.glob("configs/*/*fedmgp*.yaml"))]
    configs += [load_config(p) for p in sorted(root.glob("configs/fedmgp/*.yaml"))]
    for path in ("benchmarks/fedmgp_cifar100_cpu.yaml", "configs/papers/fedmgp/table1_cifar100.yaml"):
        study, study_dir = load_study(root / path)
        configs += [cell_config(study, study_dir, cell, 0) for cell in study.cells]
    assert len(configs) == 2 + 3 + 15 + 12  # presets, CPU study (12 cells + 2 local-only controls + a diagnosis)
    # and the paper study
    for cfg in configs:
        assert cfg.scenario.kind == "personalized" and cfg.eval.regime == "client_local"
        assert personalized_class_count(cfg.scenario, 100) == 100


def test_study_table_shows_per_task_accuracy_and_retention_from_the_summary_keys(tmp_path) -> None:
    """The FedMGP table's columns come from the generic summary-key columns (no study option needed)."""
    import json

    from promptfcl.report.collect import aggregate, groups_from_runs
    from promptfcl.study import markdown_table

    dirs = []
    for cell, kr in (("a", 90.0), ("b", None)):
        run_dir = tmp_path / cell / "seed0"
        run_dir.mkdir(parents=True)
        summary = {"faa": 70.0, "average_forgetting": 10.0, "bwt": -10.0, "task_accuracy": {"1": 60.0, "2": 80.0}}
        if kr is not None:
            summary.update(kr_t=kr, kr_s=95.0)
        metrics = {
            "method": "fedmgp", "run": cell, "accuracy_matrix": [[70.0], [60.0, 80.0]], "summary": summary,
            "communication": {"mb_per_round": 0.1}, "timing": {"total_seconds": 5.0},
        }  # fmt: skip
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
        dirs.append(run_dir)
    rows, columns = aggregate(groups_from_runs(dirs))
    assert {"task_accuracy.1", "task_accuracy.2", "kr_t", "kr_s"} <= set(columns)
    table = markdown_table(rows, columns)
    assert "90.00" in table and "95.00" in table and "80.00" in table


def test_build_regime_picks_client_local_for_personalized_scenarios_and_refuses_it_elsewhere() -> None:
    import torch

    from promptfcl.config import ConfigError, EvalConfig
    from promptfcl.evaluation.regimes import build_regime

    y = targets(12, 10)
    personal = build_personalized(async_cfg(), y, y, 12, 0)
    cpu = torch.device("cpu")
    for regime in ("auto", "client_local"):
        built = build_regime(EvalConfig(regime=regime), personal, None, None, cpu, grid=ScriptedGrid({}))
        assert isinstance(built, ClientLocalRegime) and built.every_round  # KR_t / KR_s every round by default
    quiet = build_regime(EvalConfig(retention_every_round=False), personal, None, None, cpu, ScriptedGrid({}))
    assert not quiet.every_round and quiet.round_stamp(last=False) == {} and quiet.round_stamp(last=True)
    plain = Scenario(0, 4, [0, 1, 2, 3], [[0, 1], [2, 3]], [], [np.arange(2), np.arange(2)], [[[0]], [[0]]], 1)
    with pytest.raises(ConfigError, match="personalized"):
        build_regime(EvalConfig(regime="client_local"), plain, None, None, cpu, grid=ScriptedGrid({}))
