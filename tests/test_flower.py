"""Flower deployment on loopback: SuperLink + two SuperNodes + `flwr run`, against the in-process engine.

Runs when flwr is installed (`pip install 'promptfcl[flower]'`; `make test` installs it) and skips otherwise.
Every process started here is killed at the end, including the SuperExecs they spawn.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from promptfcl.config import build_config, load_config
from promptfcl.experiment import Experiment

from .conftest import tiny_raw

pytest.importorskip("flwr", reason="flwr not installed: pip install 'promptfcl[flower]'")
pytestmark = [pytest.mark.flower, pytest.mark.slow]

from promptfcl.flower.loopback import LoopbackFederation  # noqa: E402
from promptfcl.flower.simulation import _environ_of, _status_of  # noqa: E402


@pytest.mark.parametrize("secure", [True], ids=["tls_node_auth"])
def test_flower_deployment_equals_in_process_engine(tmp_path: Path, secure: bool) -> None:
    """A 2-task fedavg_prompt run, then a 1-task HGP run (server-side step) keeping client optimiser state, over TLS
    with node authentication (the deployment path). The insecure transport runs in the node-loss tests below; its
    equality run is left out to keep the suite within its time budget (add False to the parametrisation when
    touching the transport)."""
    from promptfcl.flower.project import write_app

    base = tiny_raw(scenario={"num_tasks": 2, "num_clients": 2, "rounds_per_task": 1})
    hgp = {"name": "hgp", "length": 4, "layers": [0, 1], "local_epochs": 1, "batch_size": 8, "lr": 0.01}
    one_task = {**base, "scenario": {**base["scenario"], "num_tasks": 1, "rounds_per_task": 2}}
    one_task["data"] = {**base["data"], "options": {**base["data"]["options"], "num_classes": 3}}
    runs = {
        "fedavg_prompt": base,
        "hgp_kept_optimizer": {**one_task, "method": {**hgp, "optimizer_reset": "never"}},
    }
    references = {}
    for name, raw in runs.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
        references[name] = Experiment(build_config(raw), tmp_path / f"inproc_{name}", show_progress=False).run()
    # the kept optimiser state matters, so equality below shows the nodes persisted it in context.state
    Experiment(build_config({**one_task, "method": hgp}), tmp_path / "reset", show_progress=False).run()
    kept = load_file(str(tmp_path / "inproc_hgp_kept_optimizer" / "checkpoint.safetensors"))
    reset = load_file(str(tmp_path / "reset" / "checkpoint.safetensors"))
    assert not torch.equal(kept["server/prompt.prompts"], reset["server/prompt.prompts"])

    app = write_app(tmp_path / "app")
    fed = LoopbackFederation(tmp_path / "flwr_home", clients=2, secure=secure)
    try:
        assert fed.wait_online(2) == 2  # with TLS + node auth, the intruder's unregistered key is refused
        results = {
            name: fed.run(app, f"config-file='{tmp_path / f'{name}.yaml'}' run-dir='{tmp_path / f'flower_{name}'}'")
            for name in runs
        }
        workers = fed.worker_status()
    finally:
        fed.stop()
    # one worker per (node, run config), each built its runtime (and so the frozen backbone) exactly once and
    # served every message of its node: fedavg_prompt 2 tasks x 1 round, hgp 2 rounds
    assert len(workers) == 4 and all(w["runtime_builds"] == 1 and w["errors"] == 0 for w in workers)
    assert sorted(w["messages"] for w in workers) == [2, 2, 2, 2]
    for name, reference in references.items():
        result = results[name]
        assert result["accuracy_matrix"] == reference["accuracy_matrix"], name
        assert result["communication"] == reference["communication"], name  # bytes counted identically
        ours = load_file(str(tmp_path / f"flower_{name}" / "checkpoint.safetensors"))
        ref = load_file(str(tmp_path / f"inproc_{name}" / "checkpoint.safetensors"))
        server_keys = [k for k in ref if k.startswith("server/")]
        assert server_keys and all((ours[k] == ref[k]).all() for k in server_keys), name  # equal global state
    assert all(p.poll() is not None for p in fed.procs)


def test_flower_simulation_engine_equals_in_process_engine(tmp_path: Path) -> None:
    """`promptfcl run --engine flower-sim`: Flower's simulation runtime (Ray), same numbers as in-process."""
    from promptfcl.cli import main

    raw = tiny_raw(scenario={"num_tasks": 2, "num_clients": 2, "rounds_per_task": 1})
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["run", str(cfg), "--quiet", "--run-dir", str(tmp_path / "inproc")]) == 0
    assert main(["run", str(cfg), "--engine", "flower-sim", "--run-dir", str(tmp_path / "sim")]) == 0
    assert load_config(tmp_path / "sim" / "config.yaml").engine.kind == "flower-sim"  # recorded: --resume uses it
    ours = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    ref = json.loads((tmp_path / "inproc" / "metrics.json").read_text())
    assert ours["accuracy_matrix"] == ref["accuracy_matrix"] and ours["communication"] == ref["communication"]
    log, checkpoint = tmp_path / "sim" / "flower" / "flwr_run.log", tmp_path / "sim" / "checkpoint.safetensors"
    first, saved = log.stat().st_mtime_ns, checkpoint.stat().st_mtime_ns
    assert main(["run", "--resume", str(tmp_path / "sim"), "--quiet"]) == 0  # on the recorded engine: Flower again
    assert log.stat().st_mtime_ns > first  # a second simulation ran ...
    assert checkpoint.stat().st_mtime_ns == saved  # ... and resumed after the last round: no round ran again
    again = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    assert again["accuracy_matrix"] == ref["accuracy_matrix"]
    leftover = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    homes = [_environ_of(line.split()[0]) for line in leftover if "flower-superlink" in line]
    assert not any(str(tmp_path / "sim") in env for env in homes)  # the simulation SuperLink was stopped


def test_flower_node_killed_mid_run_is_dropped_and_recorded(tmp_path: Path) -> None:
    """A SuperNode killed after the first round never answers the second: the round drops it as soon as the
    SuperLink sees it offline (its heartbeats stopped), records why, aggregates the reply that came, and the run
    finishes. The live node is not held to a short fixed timeout (the floor here is 300 s): on a busy machine it
    is waited for."""
    from promptfcl.flower.project import write_app

    raw = tiny_raw(scenario={"num_tasks": 1, "num_clients": 2, "rounds_per_task": 2})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    app = write_app(tmp_path / "app")
    with LoopbackFederation(tmp_path / "flwr_home", clients=2) as fed:
        assert fed.wait_online(2) == 2
        proc = fed.start_run(app, f"config-file='{tmp_path / 'cfg.yaml'}' run-dir='{run_dir}' timeout=300.0")
        deadline = time.monotonic() + 600
        while not (run_dir / "rounds.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        fed.kill_node(1)
        result = fed.result(proc, timeout=900)
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert not leftovers(fed.home)
    assert len(rounds) == 2 and rounds[0]["failures"] == [] and rounds[0]["clients"] == 2
    assert rounds[1]["failures"] == [
        {"client": 1, "reason": "node offline (liveness)", "kind": "no_reply", "attempt": 0, "injected": False}
    ]
    assert rounds[1]["clients"] == 1  # the round aggregated the reply that came
    assert len(result["accuracy_matrix"]) == 1
    assert all(p.poll() is not None for p in fed.procs)


def test_flower_three_nodes_one_killed_mid_round(tmp_path: Path) -> None:
    """3 SuperNodes; node 2 is killed while it is handling its round-1 message (held there by an injected
    `slow` fault of 1200 s, so the message is certainly in flight). The round drops that message from Flower's
    node liveness within about a minute of the kill — long before the 300 s live-node floor, let alone the
    fault's 1200 s — aggregates the other two replies, and the run finishes; no process is left behind."""
    from promptfcl.flower.project import write_app

    raw = tiny_raw(
        scenario={"num_tasks": 1, "num_clients": 3, "rounds_per_task": 2},
        engine={"client_timeout": 1000.0, "faults": [{"kind": "slow", "client": 2, "rounds": [1], "delay": 1200.0}]},
    )
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    app = write_app(tmp_path / "app")
    with LoopbackFederation(tmp_path / "flwr_home", clients=3) as fed:
        assert fed.wait_online(3) == 3
        proc = fed.start_run(app, f"config-file='{tmp_path / 'cfg.yaml'}' run-dir='{run_dir}' timeout=300.0")
        deadline = time.monotonic() + 600
        busy = False
        while not busy and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            node2 = [w for w in fed.worker_status() if w.get("partition_id") == 2]
            busy = bool(node2) and node2[0]["messages"] == 1 and node2[0]["busy"]  # inside its round-1 step
        assert busy, "node 2 never started its round-1 message"
        killed = time.monotonic()
        fed.kill_node(2)
        result = fed.result(proc, timeout=900)
        after_kill = time.monotonic() - killed
        workers = fed.worker_status()
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 2 and rounds[0]["failures"] == [] and rounds[0]["clients"] == 3
    # dropped because the node went offline (injected: the fault plan touched it), not at a time limit
    assert rounds[1]["failures"] == [
        {"client": 2, "reason": "node offline (liveness)", "kind": "no_reply", "attempt": 0, "injected": True}
    ]
    assert rounds[1]["clients"] == 2  # the other two replies were aggregated
    assert after_kill < 300.0, after_kill  # promptly: well before the live-node floor
    assert len(result["accuracy_matrix"]) == 1
    assert all(p.poll() is not None for p in fed.procs)
    assert len(workers) == 3 and not leftovers(fed.home)  # SuperLink, SuperNodes, executors, workers: all gone


def leftovers(home: Path, wait: float = 15.0) -> list[str]:
    """Live (not zombie) processes whose environment names this federation's FLWR_HOME, after `wait` s."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for line in subprocess.run(
            ["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True
        ).stdout.splitlines()[1:]:
            pid = line.split()[0]
            if str(home) in _environ_of(pid) and "State:\tZ" not in _status_of(int(pid)):
                found.append(line)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
