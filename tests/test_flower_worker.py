"""The per-node worker behind the Flower ClientApp: runtime built once, same numbers as in-process, errors
reported, state carried through the node's `context.state`. No SuperLink needed, so this runs in seconds."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from promptfcl.config import build_config
from promptfcl.federation.inprocess import run_client
from promptfcl.federation.message import Message, Record
from promptfcl.methods import METHODS
from promptfcl.runtime import Runtime

from .conftest import tiny_raw

pytest.importorskip("flwr", reason="flwr not installed: pip install 'promptfcl[flower]'")

from flwr.app import RecordDict  # noqa: E402

from promptfcl.flower.node_worker import from_bytes, to_bytes  # noqa: E402
from promptfcl.flower.records import from_record_dict, load_state, to_record_dict  # noqa: E402
from promptfcl.flower.worker_link import WorkerError, call_worker, socket_path  # noqa: E402


def test_every_method_message_kind_reaches_the_clientapp_through_its_two_handlers() -> None:
    """Every kind a registered client program handles maps to a Flower message type the ClientApp registers (train,
    or the one promptfcl query), and the kind itself survives the record round trip."""
    from promptfcl.flower.client_app import app
    from promptfcl.flower.records import flower_message_type

    registered = set(app._registered_funcs)  # noqa: SLF001 - Flower keeps its routes here
    kinds = {k for _, spec in METHODS.items() for k in spec.client.message_kinds}
    assert {"train", "evaluate", "stats", "gram", "signature", "label_counts", "update"} <= kinds
    for kind in kinds:
        sent = flower_message_type(kind)
        assert (sent if "." in sent else f"{sent}.default") in registered, kind  # Flower's name for a bare type
        assert from_record_dict(to_record_dict(Message(kind=kind))).kind == kind


def test_node_worker_builds_runtime_once_and_matches_in_process(tmp_path: Path) -> None:
    raw = tiny_raw(method={"optimizer_reset": "never", "local_epochs": 1})  # client state: Adam moments
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    run_config = {"config-file": str(cfg_file), "overrides": "[]", "worker-idle-timeout": 60.0}
    node_config = {"partition-id": 1, "worker-dir": str(tmp_path / "w")}

    rt = Runtime.build(build_config(raw))
    server, client = rt.programs()
    ref_state = Record()
    flower_state = RecordDict()
    sock = socket_path(node_config, 7, run_config)
    try:
        for rnd in range(2):
            msg = Message(server.model.get_state(), {"task": 0, "round": rnd}, kind="train")
            ref = run_client(client, msg.copy(), 1, ref_state, rt.scenario, rt.dataset.train, raw["seed"], rt.device)
            content = to_bytes(to_record_dict(msg))
            reply, state = call_worker(node_config, 7, run_config, content, to_bytes(flower_state))
            flower_state = from_bytes(state)
            ours = from_record_dict(from_bytes(reply))
            assert ours.scalars == ref.scalars and ours.tensors.keys() == ref.tensors.keys()
            assert all(torch.equal(ours.tensors[k], ref.tensors[k]) for k in ref.tensors)
            kept = load_state(flower_state)
            assert kept.tensors.keys() == ref_state.tensors.keys() and kept.tensors  # optimiser state carried
            assert all(torch.equal(kept.tensors[k], ref_state.tensors[k]) for k in kept.tensors)

        bad = Message({}, {"task": 0, "round": 0}, kind="no_such_kind")
        with pytest.raises(WorkerError, match="cannot handle message kind"):
            call_worker(node_config, 7, run_config, to_bytes(to_record_dict(bad)), to_bytes(RecordDict()))

        status = json.loads(sock.with_suffix(".status.json").read_text())
        assert status["runtime_builds"] == 1 and status["messages"] == 2 and status["errors"] == 1
        sock.unlink()  # a worker whose socket is removed exits by itself
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(status["pid"]):
            time.sleep(0.5)
        assert not _alive(status["pid"])
    finally:
        with contextlib.suppress(Exception):
            os.kill(json.loads(sock.with_suffix(".status.json").read_text())["pid"], signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # reap it if it is our child (a zombie is not alive)
            return False
    return True
