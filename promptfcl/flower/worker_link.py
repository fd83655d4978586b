"""The ClientApp side of the per-node worker: find (or start) the node's worker and hand it one message.

Flower 1.41 starts a fresh ClientApp process for every message a SuperNode receives. Building promptfcl's
runtime there (dataset decode, scenario, frozen backbone) would repeat for every message, so by default each
SuperNode gets one long-lived worker process (`promptfcl.flower.node_worker`) that builds the runtime once and
serves every ClientApp process of that node over a Unix socket readable only by the node's user. The
ClientApp process only relays bytes: it imports neither torch nor promptfcl's model code, so its own start-up
is Python plus Flower.

Wire format: length-prefixed frames (8-byte little-endian length, then the bytes). Request: a JSON header, the
message content and the node's `context.state`, both as Flower `RecordDict` protobufs. Reply: a JSON header
(`{"ok": true}` or `{"ok": false, "error": ...}`), the reply content and the updated state. Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FRAME_HEADER = 8
DEFAULT_IDLE_TIMEOUT = 900.0
DEFAULT_START_TIMEOUT = 900.0


class WorkerError(RuntimeError):
    """The node worker could not be reached, could not start, or failed while handling a message."""


def send_frames(conn: socket.socket, *frames: bytes) -> None:
    conn.sendall(b"".join(len(f).to_bytes(FRAME_HEADER, "little") + f for f in frames))


def recv_frames(conn: socket.socket, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        n = int.from_bytes(_recv_exact(conn, FRAME_HEADER), "little")
        out.append(_recv_exact(conn, n))
    return out


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("the other side closed the connection mid-message")
        buf += chunk
    return bytes(buf)


def run_key(run_config: Mapping[str, Any]) -> str:
    """What identifies a runtime: the experiment config file and its overrides."""
    return json.dumps([str(run_config.get("config-file")), str(run_config.get("overrides", "[]"))])


def worker_dir(node_config: Mapping[str, Any]) -> Path:
    """Where a node's worker sockets live: `worker-dir` from the node config, else a private temp folder."""
    configured = node_config.get("worker-dir")
    path = Path(str(configured)) if configured else Path(tempfile.gettempdir()) / f"promptfcl-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def socket_path(node_config: Mapping[str, Any], node_id: int, run_config: Mapping[str, Any]) -> Path:
    """One worker per (Flower home, node, runtime); short names keep under the Unix socket path limit."""
    ident = json.dumps([os.environ.get("FLWR_HOME", ""), int(node_id), run_key(run_config)])
    return worker_dir(node_config) / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.sock"


def _connect(path: Path, timeout: float | None) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    try:
        conn.connect(str(path))
    except OSError:
        conn.close()
        raise
    return conn


def _start_worker(path: Path, run_config: Mapping[str, Any], idle_timeout: float, start_timeout: float) -> None:
    """Start the node's worker (once, under a lock) and wait until its socket accepts connections."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            _connect(path, 5.0).close()
            return  # another ClientApp process started it while we waited for the lock
        log = open(path.with_suffix(".log"), "ab")  # noqa: SIM115 - handed to the worker process
        cmd = [sys.executable, "-m", "promptfcl.flower.node_worker", "--socket", str(path)]
        cmd += ["--config-file", str(run_config["config-file"]), "--overrides", str(run_config.get("overrides", "[]"))]
        cmd += ["--idle-timeout", str(idle_timeout), "--parent-pid", str(os.getppid())]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = path.with_suffix(".log").read_text(errors="replace")[-3000:]
                raise WorkerError(f"the promptfcl node worker exited with code {proc.returncode}:\n{tail}")
            with contextlib.suppress(OSError):
                _connect(path, 5.0).close()
                return
            time.sleep(0.2)
        proc.kill()
        raise WorkerError(f"the promptfcl node worker did not start within {start_timeout:.0f} s (see {path}.log)")


def ensure_worker(node_config: Mapping[str, Any], node_id: int, run_config: Mapping[str, Any]) -> Path:
    """The socket of the node's worker for this run config, started (and its runtime built) if needed."""
    path = socket_path(node_config, node_id, run_config)
    try:
        _connect(path, 5.0).close()
    except OSError:
        idle = float(run_config.get("worker-idle-timeout", DEFAULT_IDLE_TIMEOUT))
        _start_worker(path, run_config, idle, float(run_config.get("worker-start-timeout", DEFAULT_START_TIMEOUT)))
    return path


def call_worker(
    node_config: Mapping[str, Any],
    node_id: int,
    run_config: Mapping[str, Any],
    content: bytes,
    state: bytes,
) -> tuple[bytes, bytes]:
    """Hand one message (and the node's state) to the node's worker, starting it if needed."""
    conn = _connect(ensure_worker(node_config, node_id, run_config), None)
    header = json.dumps({"partition-id": int(node_config["partition-id"])}).encode()
    with conn:
        try:
            send_frames(conn, header, content, state)
            reply_header, reply, new_state = recv_frames(conn, 3)
        except OSError as e:
            raise WorkerError(f"lost the promptfcl node worker mid-message: {e}") from e
    status = json.loads(reply_header)
    if not status.get("ok"):
        raise WorkerError(f"the promptfcl node worker failed: {status.get('error')}")
    return reply, new_state
