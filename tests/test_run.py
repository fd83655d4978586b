"""End-to-end runs: result files, determinism, and resume after a hard kill (SIGKILL) mid-task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from promptfcl.config import build_config
from promptfcl.experiment import Experiment

from .conftest import tiny_config, tiny_raw

RESULT_FILES = [
    "config.yaml",
    "scenario.json",
    "scenario_heatmap.png",
    "metrics.json",
    "accuracy_matrix.csv",
    "rounds.jsonl",
    "accuracy_matrix.png",
    "accuracy_curve.png",
    "report.md",
    "environment.json",
]


def comparable(metrics: dict) -> dict:
    """Everything but wall-clock timings."""
    return {k: v for k, v in metrics.items() if k != "timing"}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedavg_prompt", "fedvit"])
def test_run_writes_every_result_and_is_deterministic(tmp_path: Path, method: str) -> None:
    raw = tiny_raw(method={"name": method})
    if method == "fedvit":
        del raw["method"]["layers"]
    cfg = build_config(raw)
    m1 = Experiment(cfg, tmp_path / "a", show_progress=False).run()
    m2 = Experiment(cfg, tmp_path / "b", show_progress=False).run()
    assert comparable(m1) == comparable(m2)
    for f in RESULT_FILES:
        assert (tmp_path / "a" / f).is_file(), f
    A = m1["accuracy_matrix"]
    assert len(A) == 2 and len(A[1]) == 2
    rounds = [json.loads(line) for line in (tmp_path / "a" / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 4 and all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rounds)
    assert m1["communication"]["bytes_up"] == sum(r["bytes_up"] for r in rounds)
    # learning happened: the tiny model beats chance (1/3 within a task of 3 classes) on the first task
    assert A[0][0] > 50.0


def test_train_seed_changes_training_but_not_the_scenario(tmp_path: Path) -> None:
    """`train_seed` re-runs the same scenario (data, class order, partition) with other training randomness;
    left unset it is `seed`, so runs without it are unchanged."""
    cfg = tiny_config(scenario={"num_tasks": 1, "rounds_per_task": 1})
    base = Experiment(cfg, tmp_path / "a", show_progress=False).run()
    same = Experiment(cfg.model_copy(update={"train_seed": 0}), tmp_path / "b", show_progress=False).run()
    other = Experiment(cfg.model_copy(update={"train_seed": 7}), tmp_path / "c", show_progress=False).run()
    assert comparable(same) == comparable(base)
    assert base["train_seed"] == 0 and other["train_seed"] == 7 and other["seed"] == 0
    scenario = {d: json.loads((tmp_path / d / "scenario.json").read_text()) for d in "ac"}
    assert scenario["a"] == scenario["c"]
    from promptfcl.runtime import Runtime

    state = {d: Runtime.restore_server(tmp_path / d)[1].state().tensors for d in "ac"}
    assert not torch.equal(state["a"]["prompt.prompts"], state["c"]["prompt.prompts"])


def test_fedvit_rejects_prompt_keys(tmp_path: Path) -> None:
    from promptfcl.config import ConfigError

    with pytest.raises(ConfigError, match="method.layers"):
        Experiment(tiny_config(method={"name": "fedvit"}), tmp_path, show_progress=False).run()


def test_prompt_and_head_are_what_travels(tmp_path: Path) -> None:
    cfg = tiny_config(scenario={"num_tasks": 1, "rounds_per_task": 1})
    exp = Experiment(cfg, tmp_path, show_progress=False)
    exp.run()
    names = set(exp.server.state().tensors)
    assert names == {"prompt.prompts", "head.weight", "head.bias"}
    per_msg = sum(t.numel() * 4 for t in exp.server.state().tensors.values())
    r = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[0])
    assert per_msg * 3 < r["bytes_down"] < per_msg * 3 + 3 * 200  # 3 clients: params + a few scalars each


# Resume after SIGKILL (three random rounds), SIGTERM and damaged checkpoints: tests/test_crash_safety.py


def test_restore_server_gives_back_the_finished_runs_model(tmp_path: Path) -> None:
    """Diagnostics (benchmarks/*.py) load a finished run through `Runtime.restore_server`: its global model must be
    the one the run scored, so the last row of the accuracy matrix is reproduced from the checkpoint alone."""
    from promptfcl.evaluation.evaluator import Evaluator
    from promptfcl.runtime import Runtime

    metrics = Experiment(tiny_config(), tmp_path, show_progress=False).run()
    rt, server = Runtime.restore_server(tmp_path)
    fresh = rt.programs()[0].global_model().state_dict()
    restored = server.global_model().state_dict()
    assert any(not torch.equal(fresh[k], restored[k]) for k in restored)  # not the factory's initial model
    ev = Evaluator(rt.dataset.test, rt.scenario, rt.env.eval_transform, 64, rt.device)
    last = len(metrics["accuracy_matrix"]) - 1
    scored = [r.accuracy for r in ev.evaluate(server.global_model().eval(), last)]
    assert scored == pytest.approx(metrics["accuracy_matrix"][last][: len(scored)], abs=1e-6)
