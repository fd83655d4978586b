"""The round log records each round's client, server and evaluation time as process CPU seconds beside the wall
times, so a run can be compared with an external code's CPU seconds."""

from __future__ import annotations

import json

import pytest
import torch

from promptfcl.experiment import Experiment

from .conftest import tiny_config

FIELDS = ("client", "server", "eval")


def test_rounds_log_cpu_seconds_beside_wall_seconds(tmp_path) -> None:
    cfg = tiny_config(engine={"device": "cpu", "threads": 1}, eval={"every_round": True})
    threads = torch.get_num_threads()
    try:
        metrics = Experiment(cfg, tmp_path, show_progress=False).run()
    finally:
        torch.set_num_threads(threads)  # engine.threads is process-wide: leave the other tests theirs
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 4
    for r in rounds:
        for f in FIELDS:
            wall, cpu = r[f"{f}_seconds"], r[f"{f}_cpu_seconds"]
            assert wall > 0 and cpu > 0, (f, r["task"], r["round"], wall, cpu)
            # one torch thread and clients one after another: the process cannot burn more CPU than wall time
            assert cpu <= wall * 1.25 + 0.05, (f, wall, cpu)
        assert r["server_seconds"] == pytest.approx(r["seconds"] - r["client_seconds"], abs=2e-4)
    timing = metrics["timing"]
    for f in FIELDS:  # the run's totals are the rounds' sums
        assert timing[f"{f}_cpu_seconds"] == pytest.approx(sum(r[f"{f}_cpu_seconds"] for r in rounds), abs=1e-3)


def test_rounds_without_evaluation_log_zero_evaluation_time(tmp_path) -> None:
    Experiment(tiny_config(), tmp_path, show_progress=False).run()
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    evaluated = [r for r in rounds if "accuracy" in r]
    assert evaluated and len(evaluated) < len(rounds)
    for r in rounds:
        assert r["client_cpu_seconds"] > 0 and r["server_cpu_seconds"] > 0
        assert (r["eval_cpu_seconds"] > 0) == ("accuracy" in r) and (r["eval_seconds"] > 0) == ("accuracy" in r)
