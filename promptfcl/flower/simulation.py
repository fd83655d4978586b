"""`promptfcl run CONFIG` with `engine.kind: flower-sim` (or `--engine flower-sim`): the experiment through
Flower's simulation runtime.

Flower's only supported simulation path is `flwr run` against a local simulation SuperLink (Ray backend, one
virtual SuperNode per client, `partition-id` set by Flower). This writes the app project and a private
`FLWR_HOME` with a `:local:` connection of `num-supernodes = scenario clients` under the run directory, runs
`flwr run APP sim --stream`, reads the result line the ServerApp prints, and stops the detached simulation
SuperLink. Results land in the run directory exactly as with the in-process engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from promptfcl.config import ConfigError, ExperimentConfig, dump_config
from promptfcl.flower.project import write_app
from promptfcl.scenario.common import client_slots


def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        raise ConfigError(f"{name} not found: install the Flower extra with pip install 'promptfcl[flower]'")
    return found


def simulation_clients(cfg: ExperimentConfig) -> int:
    """Virtual SuperNodes needed: one per client slot of the scenario."""
    return client_slots(cfg.scenario)


def run_flower_simulation(
    cfg: ExperimentConfig, run_dir: Path, timeout: float = 24 * 3600, resume: bool = False
) -> dict[str, Any]:
    """Run `cfg` on Flower's simulation engine; returns the ServerApp's result (summary, matrix, bytes).

    `resume`: continue the run in `run_dir` from its last checkpoint (the ServerApp's `resume` run-config key;
    clients start with empty states, since Flower's nodes keep theirs and a new simulation has new nodes)."""
    try:
        import flwr  # noqa: F401
        import ray  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"engine.kind: flower-sim needs pip install 'promptfcl[flower]' (flwr[simulation]): {e}"
        ) from None
    run_dir = run_dir.resolve()
    work = run_dir / "flower"
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    cfg_file = work / "config.yaml"
    cfg_file.write_text(dump_config(cfg))
    app = write_app(work / "app")
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        # promptfcl is installed already: the simulation SuperLink must not `uv sync` the app into a new env
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }
    flwr = _bin("flwr")
    subprocess.run([flwr, "config", "list"], env=env, capture_output=True, timeout=120)
    settings = home / "config.toml"
    if "[superlink.sim]" not in (settings.read_text() if settings.is_file() else ""):  # (a resumed run's is there)
        with open(settings, "a") as f:
            f.write('\n[superlink.sim]\naddress = ":local:"\n')
    run_config = f"config-file='{cfg_file}' run-dir='{run_dir}' node-worker=false"
    if resume:
        run_config += " resume=true"
    n = str(simulation_clients(cfg))
    try:
        subprocess.run(
            [flwr, "federation", "simulation-config", "@none/default", "sim", "--num-supernodes", n],
            env=env, capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        out = subprocess.run(
            [flwr, "run", str(app), "sim", "--stream", "--run-config", run_config],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    finally:
        _stop_local_superlink(home)
    (work / "flwr_run.log").write_text(out.stdout + "\n" + out.stderr)
    for line in out.stdout.splitlines():
        if line.startswith('{"promptfcl"'):
            return json.loads(line)["promptfcl"]
    raise ConfigError(f"the Flower simulation produced no result; see {work / 'flwr_run.log'}")


def _stop_local_superlink(home: Path) -> None:
    """Kill the detached `flower-superlink --simulation` that `flwr run` started for this FLWR_HOME."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True)
    for line in out.stdout.splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        ours = str(home) in args or str(home) in _environ_of(pid)  # its log and database live under FLWR_HOME
        if "flower-superlink" in args and "--simulation" in args and ours:
            _terminate(int(pid))


def _terminate(pid: int, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if the process is still there after `grace` seconds: a simulation SuperLink left
    running would be reused by the next `flwr run` on this machine (it listens on a fixed local port)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or "State:\tZ" in _status_of(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _status_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text(errors="replace")
    except OSError:
        return ""


def _environ_of(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""
