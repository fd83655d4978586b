"""The local-only control of FedAvg-style methods (`method.local_only: true`): each client resumes from its own
model, nothing is averaged, and the run is scored as the mean over clients of each client's own model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from promptfcl.config import build_config
from promptfcl.experiment import Experiment

from .conftest import interrupted_then_resumed, tiny_raw
from .test_hgp import recorded_run

LOCAL = {"method": {"local_only": True}, "scenario": {"participation": {"fraction": 0.5, "mode": "per_round"}}}


def test_each_client_resumes_from_its_own_model_and_nothing_is_averaged(tmp_path: Path) -> None:
    exp, log = recorded_run(build_config(tiny_raw(**LOCAL)), tmp_path / "run")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    initial = exp.server.local.initial
    last: dict[int, dict[str, torch.Tensor]] = {}  # each client's latest upload
    for _t, _r, sent, replies in log:
        for client, message in sent.items():
            expected = last.get(client, initial)  # its own last model, or the initial one the first time
            assert all(torch.equal(message.tensors[k], expected[k]) for k in initial), client
        for client, reply in replies.items():
            last[client] = {k: reply.tensors[k] for k in initial}
    assert len(last) == 3 and any(len(sent) < 3 for _t, _r, sent, _rep in log)  # some rounds skip a client
    a, b = last[0]["prompt.prompts"], last[1]["prompt.prompts"]
    assert not torch.equal(a, b)  # two clients' models never met
    glob = exp.server.global_model().get_state()  # the global model is never touched
    assert all(torch.equal(glob[k], initial[k]) for k in initial)
    assert metrics["scored_model"] == "clients"
    first = json.loads((tmp_path / "run" / "rounds.jsonl").read_text().splitlines()[0])
    assert first["move/prompt"] > 0 and first["move/head"] > 0  # a client's first training counts as a move


def test_the_run_is_scored_as_the_mean_over_clients_of_each_clients_model(tmp_path: Path) -> None:
    exp, _log = recorded_run(build_config(tiny_raw(**LOCAL)), tmp_path / "run")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    last = len(exp.evaluator.subsets) - 1
    per_client = []
    for client in range(3):
        model = exp.server.new_model()
        model.set_state(exp.server.local.state_of(client))
        per_client.append([r.accuracy for r in exp.evaluator.evaluate(model, last)])
    mean = [sum(acc[t] for acc in per_client) / 3 for t in range(last + 1)]
    assert metrics["accuracy_matrix"][-1] == pytest.approx(mean)
    glob = [r.accuracy for r in exp.evaluator.evaluate(exp.server.global_model(), last)]
    assert metrics["accuracy_matrix"][-1] != pytest.approx(glob)  # not the (untrained) global model


def test_a_method_with_its_own_round_is_refused(tmp_path: Path) -> None:
    raw = tiny_raw(method={"name": "hgp", "local_only": True}, scenario={"num_tasks": 1})
    with pytest.raises(ValueError, match="local_only: .* changes the FedAvg round"):
        Experiment(build_config(raw), tmp_path / "run", show_progress=False).run()


def test_an_interrupted_local_only_run_resumes_to_the_same_numbers(tmp_path: Path) -> None:
    # one client per round: after the first round three clients still hold the initial model (checkpointed apart)
    raw = tiny_raw(method={"local_only": True}, scenario={"num_clients": 4, "participation": {"fraction": 0.25}})
    whole = Experiment(build_config(raw), tmp_path / "whole", show_progress=False).run()
    resumed = interrupted_then_resumed(build_config(raw), tmp_path / "cut", rounds=3)
    assert resumed["accuracy_matrix"] == whole["accuracy_matrix"]
