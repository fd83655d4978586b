"""Flower deployment on loopback: SuperLink + two SuperNodes + `flwr run`, against the in-process engine.

Runs when flwr is installed (`pip install 'promptfcl[flower]'`; `make test` installs it) and skips otherwise.
Every process started here is killed at the end, including the SuperExecs they spawn.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from promptfcl.config import build_config
from promptfcl.experiment import Experiment

from .conftest import tiny_raw

pytest.importorskip("flwr", reason="flwr not installed: pip install 'promptfcl[flower]'")
pytestmark = [pytest.mark.flower, pytest.mark.slow]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Federation:
    """A SuperLink and N SuperNodes on 127.0.0.1, FLWR_HOME in a temp dir; `stop()` kills them all.

    `secure=True` is set up as a real deployment: TLS with a CA made here (`--ssl-*` on the SuperLink,
    `--root-certificates` on the nodes and the CLI connection) and SuperNode authentication
    (`--enable-supernode-auth`, each node's public key registered with `flwr supernode register`, its private
    key given to `flower-supernode`), plus an intruder node whose key is not registered. `secure=False` is the
    plain loopback recipe (`--insecure`). Each node's promptfcl worker keeps its socket and status in
    `worker_dir`.
    """

    def __init__(self, home: Path, clients: int, secure: bool) -> None:
        from promptfcl.flower.security import make_node_keys, make_tls

        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.worker_dir = Path(tempfile.mkdtemp(prefix="pfw"))  # short: Unix socket paths are limited
        self.env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: list[subprocess.Popen] = []
        self.port = free_port()  # the SuperLink's one Runtime HTTP API (fleet, control, serverappio)
        link = [str(BIN / "flower-superlink"), "--disable-runtime-dependency-installation", "--port", str(self.port)]
        names = [f"node{k}" for k in range(clients)]
        if secure:
            tls = make_tls(home / "certs", ["127.0.0.1", "localhost"])
            self.keys = make_node_keys(home / "keys", [*names, "intruder"])
            link += ["--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["cert"])]
            link += ["--ssl-keyfile", str(tls["key"]), "--enable-supernode-auth"]
            connection = f'root-certificates = "{tls["ca"]}"'
        else:
            link += ["--insecure"]
            connection = "insecure = true"
        self._start("superlink", link)
        subprocess.run([str(BIN / "flwr"), "config", "list"], env=self.env, capture_output=True, timeout=60)
        with open(home / "config.toml", "a") as f:
            f.write(f'\n[superlink.test]\naddress = "127.0.0.1:{self.port}"\n{connection}\n')
        time.sleep(4)
        if secure:
            for name in names:
                self.flwr("supernode", "register", str(self.keys[name][1]), "test")
        for k, name in enumerate([*names, "intruder"] if secure else names):
            node = [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}", "--port", str(free_port())]
            if secure:
                node += ["--root-certificates", str(tls["ca"]), "--auth-supernode-private-key", str(self.keys[name][0])]
            else:
                node += ["--insecure"]
            config = f"partition-id={k} num-partitions={clients} worker-dir='{self.worker_dir}'"
            self._start(name, [*node, "--node-config", config])

    def worker_status(self) -> list[dict]:
        """The status of every promptfcl node worker these nodes started (pid, runtime builds, messages)."""
        return [json.loads(p.read_text()) for p in sorted(self.worker_dir.glob("*.status.json"))]

    def flwr(self, *args: str) -> str:
        out = subprocess.run([str(BIN / "flwr"), *args], env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise AssertionError(f"flwr {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out.stdout

    def online_nodes(self) -> int:
        nodes = json.loads(self.flwr("supernode", "list", "test", "--format", "json"))["nodes"]
        return sum(n["status"] == "online" for n in nodes)

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.home / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        self.procs.append(
            subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def run(self, app: Path, run_config: str, timeout: int = 400) -> dict:
        out = subprocess.run(
            [str(BIN / "flwr"), "run", str(app), "test", "--stream", "--run-config", run_config],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        for line in out.stdout.splitlines():
            if line.startswith('{"promptfcl"'):
                return json.loads(line)["promptfcl"]
        logs = "\n".join(p.read_text()[-2000:] for p in self.home.glob("*.log"))
        raise AssertionError(f"no result line from flwr run:\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}\n{logs}")

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        for status in self.worker_status():  # node workers run in their own session: kill them by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(status["pid"], signal.SIGKILL)
        shutil.rmtree(self.worker_dir, ignore_errors=True)


@pytest.mark.parametrize("secure", [True, False], ids=["tls_node_auth", "insecure"])
def test_flower_deployment_equals_in_process_engine(tmp_path: Path, secure: bool) -> None:
    """A 2-task fedavg_prompt run, then a 1-task HGP run (server-side step) keeping client optimiser state."""
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
    fed = Federation(tmp_path / "flwr_home", clients=2, secure=secure)
    try:
        time.sleep(8)
        assert fed.online_nodes() == 2  # with TLS + node auth, the intruder's unregistered key is refused
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
    ours = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    ref = json.loads((tmp_path / "inproc" / "metrics.json").read_text())
    assert ours["accuracy_matrix"] == ref["accuracy_matrix"] and ours["communication"] == ref["communication"]
    leftover = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "sim") not in leftover  # the simulation SuperLink was stopped
