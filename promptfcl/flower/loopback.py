"""A whole Flower deployment on loopback: SuperLink + N SuperNodes + `flwr run`, all on 127.0.0.1.

`LoopbackFederation` starts the processes with `FLWR_HOME` in a folder of your choosing and `stop()` kills every
one of them, the per-node promptfcl workers included. It is what the deployment tests and
`benchmarks/flower_overhead.py` use, and a quick way to try a deployment on one machine before using several
(docs/deployment.md). Only loopback addresses are used.
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

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackFederation:
    """A SuperLink and N SuperNodes on 127.0.0.1, FLWR_HOME in a temp dir; `stop()` kills them all.

    `secure=True` is set up as a real deployment: TLS with a CA made here (`--ssl-*` on the SuperLink,
    `--root-certificates` on the nodes and the CLI connection) and SuperNode authentication
    (`--enable-supernode-auth`, each node's public key registered with `flwr supernode register`, its private
    key given to `flower-supernode`), plus an intruder node whose key is not registered. `secure=False` is the
    plain loopback recipe (`--insecure`). Each node's promptfcl worker keeps its socket and status in
    `worker_dir`.
    """

    def __init__(self, home: Path, clients: int, secure: bool = False) -> None:
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
        self.runs: list[subprocess.Popen] = []  # `flwr run` CLIs, killed by `stop()` if still running
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
        subprocess.run([str(BIN / "flwr"), "config", "list"], env=self.env, capture_output=True, timeout=120)
        with open(home / "config.toml", "a") as f:
            f.write(f'\n[superlink.test]\naddress = "127.0.0.1:{self.port}"\n{connection}\n')
        self._wait_listening(self.port)  # a busy machine may take far longer than the usual few seconds
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

    def _wait_listening(self, port: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[0].poll() is not None:
                raise RuntimeError(f"the SuperLink exited:\n{(self.home / 'superlink.log').read_text()[-3000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=2.0):
                time.sleep(1.0)  # listening; give its other services a moment
                return
            time.sleep(0.5)
        raise RuntimeError(f"the SuperLink did not listen on 127.0.0.1:{port} within {timeout:.0f} s")

    def worker_status(self) -> list[dict]:
        """The status of every promptfcl node worker these nodes started (pid, runtime builds, messages)."""
        return [json.loads(p.read_text()) for p in sorted(self.worker_dir.glob("*.status.json"))]

    def flwr(self, *args: str) -> str:
        out = subprocess.run([str(BIN / "flwr"), *args], env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"flwr {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out.stdout

    def online_nodes(self) -> int:
        nodes = json.loads(self.flwr("supernode", "list", "test", "--format", "json"))["nodes"]
        return sum(n["status"] == "online" for n in nodes)

    def wait_online(self, expected: int, timeout: float = 300.0) -> int:
        """Wait until `expected` nodes are online (or `timeout` passes); returns how many are."""
        deadline = time.monotonic() + timeout
        while self.online_nodes() < expected and time.monotonic() < deadline:
            time.sleep(1.0)
        time.sleep(2.0)  # let a node that should be refused (an unregistered key) have its try
        return self.online_nodes()

    def kill_node(self, k: int) -> None:
        """SIGKILL SuperNode `k` (and its app executor) and its promptfcl worker: the node is gone mid-run."""
        proc = self.procs[1 + k]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for status in self.worker_status():
            if status.get("partition_id") == k:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(status["pid"], signal.SIGKILL)

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.home / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        self.procs.append(
            subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def start_run(self, app: Path, run_config: str) -> subprocess.Popen:
        """`flwr run` in the background (streaming its output); `result` reads its summary line."""
        cmd = [str(BIN / "flwr"), "run", str(app), "test", "--stream", "--run-config", run_config]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.runs.append(proc)
        return proc

    def run(self, app: Path, run_config: str, timeout: int = 900) -> dict:
        """Run an experiment through the federation; returns the ServerApp's `{"promptfcl": ...}` summary."""
        return self.result(self.start_run(app, run_config), timeout)

    def result(self, proc: subprocess.Popen, timeout: int = 900) -> dict:
        stdout, stderr = proc.communicate(timeout=timeout)
        out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        for line in out.stdout.splitlines():
            if line.startswith('{"promptfcl"'):
                return json.loads(line)["promptfcl"]
        logs = "\n".join(p.read_text()[-2000:] for p in self.home.glob("*.log"))
        raise RuntimeError(f"no result line from flwr run:\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}\n{logs}")

    def stop(self) -> None:
        for run in self.runs:
            if run.poll() is None:
                run.kill()
                run.communicate(timeout=30)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        for status in self.worker_status():  # node workers run in their own session: kill them by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(status["pid"], signal.SIGKILL)
        shutil.rmtree(self.worker_dir, ignore_errors=True)

    def __enter__(self) -> LoopbackFederation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
