"""The per-SuperNode worker: builds the runtime (data, scenario, frozen backbone) once, serves every message.

`python -m promptfcl.flower.node_worker --socket PATH --config-file CFG [--overrides JSON]` is started by the
first ClientApp process of a node (see `promptfcl.flower.worker_link`) and serves that node's later messages
over a Unix socket. It exits after `--idle-timeout` seconds without a message, when `--parent-pid` (the
SuperNode's app executor) is gone, or when its socket file is removed. Its status file (`PATH` with
`.status.json`) records the pid, how many times the runtime was built (always 1), how many messages were
served and whether one is being handled now (`busy`).

`client_step` is also what the ClientApp runs in its own process when the worker is off (Flower's simulation
runtime, whose Ray workers live for the whole run anyway), so both paths are one computation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611

from promptfcl.config import load_config
from promptfcl.federation.inprocess import run_client
from promptfcl.federation.protocol import ClientProgram
from promptfcl.flower.records import from_record_dict, load_state, store_state, to_record_dict
from promptfcl.flower.worker_link import recv_frames, run_key, send_frames
from promptfcl.runtime import Runtime

_RUNTIMES: dict[str, tuple[Runtime, ClientProgram]] = {}


def runtime_for(run_config: Mapping[str, Any]) -> tuple[Runtime, ClientProgram]:
    """The runtime and client program of a run config, built once per process."""
    key = run_key(run_config)
    if key not in _RUNTIMES:
        cfg = load_config(str(run_config["config-file"]), json.loads(str(run_config.get("overrides", "[]"))))
        rt = Runtime.build(cfg)
        _RUNTIMES[key] = (rt, rt.programs()[1])
    return _RUNTIMES[key]


def client_step(run_config: Mapping[str, Any], partition_id: int, content: RecordDict, state: RecordDict) -> RecordDict:
    """Run the method's client program on one message; updates `state` in place, returns the reply content."""
    rt, client = runtime_for(run_config)
    record = load_state(state)
    reply = run_client(
        client,
        from_record_dict(content),
        partition_id,
        record,
        rt.scenario,
        rt.dataset.train,
        rt.cfg.training_seed(),
        rt.device,
    )
    store_state(state, record)
    return to_record_dict(reply)


def to_bytes(records: RecordDict) -> bytes:
    return recorddict_to_proto(records).SerializeToString()


def from_bytes(data: bytes) -> RecordDict:
    return recorddict_from_proto(ProtoRecordDict.FromString(data))


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeWorker:
    """Serves one node's messages for one run config over a Unix socket, with the runtime built once."""

    def __init__(self, sock: Path, run_config: dict[str, Any], idle_timeout: float, parent_pid: int | None) -> None:
        self.sock = sock
        self.run_config = run_config
        self.idle_timeout = idle_timeout
        self.parent_pid = parent_pid
        self.status_file = sock.with_suffix(".status.json")
        self.status = {"pid": os.getpid(), "runtime_builds": 0, "messages": 0, "errors": 0, "busy": False}

    def _write_status(self) -> None:
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.status))
        tmp.replace(self.status_file)

    def serve(self) -> None:
        runtime_for(self.run_config)  # build before accepting, so the first message does not time out waiting
        self.status["runtime_builds"] = len(_RUNTIMES)
        with contextlib.suppress(FileNotFoundError):
            self.sock.unlink()  # a stale socket of a worker that died
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.sock))
        os.chmod(self.sock, 0o600)
        server.listen(8)
        server.settimeout(2.0)
        self._write_status()
        last = time.monotonic()
        try:
            while True:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    idle = time.monotonic() - last > self.idle_timeout
                    if idle or not _alive(self.parent_pid) or not self.sock.exists():
                        return
                    continue
                with conn:
                    conn.settimeout(None)
                    self._answer(conn)
                last = time.monotonic()
        finally:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                self.sock.unlink()

    def _answer(self, conn: socket.socket) -> None:
        try:
            header, content, state = recv_frames(conn, 3)
        except OSError:
            return  # the ClientApp process went away before sending a whole message
        self.status["busy"] = True
        self._write_status()
        try:
            records = from_bytes(state)
            partition = int(json.loads(header)["partition-id"])
            self.status["partition_id"] = partition
            reply = client_step(self.run_config, partition, from_bytes(content), records)
            frames = (json.dumps({"ok": True}).encode(), to_bytes(reply), to_bytes(records))
            self.status["messages"] += 1
        except Exception as e:  # noqa: BLE001 - reported to the ClientApp, which fails the message
            self.status["errors"] += 1
            frames = (json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode(), b"", b"")
            traceback.print_exc()
        self.status["busy"] = False
        self._write_status()  # before replying, so a caller that got the reply sees the status of it
        with contextlib.suppress(OSError):
            send_frames(conn, *frames)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="promptfcl per-SuperNode worker (started by the ClientApp)")
    ap.add_argument("--socket", required=True, type=Path)
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--overrides", default="[]")
    ap.add_argument("--idle-timeout", type=float, default=900.0)
    ap.add_argument("--parent-pid", type=int, default=None)
    args = ap.parse_args(argv)
    run_config = {"config-file": args.config_file, "overrides": args.overrides}
    NodeWorker(args.socket, run_config, args.idle_timeout, args.parent_pid).serve()


if __name__ == "__main__":
    main()
