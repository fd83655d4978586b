"""Checkpoints: one safetensors file (tensors + JSON metadata), written atomically, never unpickled.

Layout of `RUN_DIR/checkpoint.safetensors`:
- tensors: `server/<name>`, `client/<id>/<name>`, `rng/torch`;
- metadata JSON: position (next task and round), server and client scalars, run progress (accuracy matrix,
  round log, …), python/numpy RNG states.
The file is written to a temporary name and renamed, so a crash leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from promptfcl.federation.message import Record, prefixed, unprefixed

CHECKPOINT_NAME = "checkpoint.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read back; the message says what to do."""


@dataclass
class Checkpoint:
    """Everything needed to continue a run from the start of round `next_round` of task `next_task`."""

    next_task: int
    next_round: int
    server: Record
    clients: dict[int, Record]
    progress: dict[str, Any] = field(default_factory=dict)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_checkpoint(run_dir: Path, ckpt: Checkpoint) -> None:
    tensors = prefixed(ckpt.server.tensors, "server/")
    for cid, state in ckpt.clients.items():
        tensors.update(prefixed(state.tensors, f"client/{cid}/"))
    tensors["rng/torch"] = torch.get_rng_state()
    scalars = {
        "position": {"next_task": ckpt.next_task, "next_round": ckpt.next_round},
        "server": ckpt.server.scalars,
        "clients": {str(cid): s.scalars for cid, s in ckpt.clients.items()},
        "progress": ckpt.progress,
        "rng": {"python": _jsonable(random.getstate()), "numpy": _numpy_state()},
    }
    atomic_write_bytes(run_dir / CHECKPOINT_NAME, Record(tensors, scalars).to_bytes())


def load_checkpoint(run_dir: Path, restore_rng: bool = True) -> Checkpoint:
    path = run_dir / CHECKPOINT_NAME
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {run_dir}: nothing to resume (start the run without --resume)")
    try:
        rec = Record.from_bytes(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e}); delete it to restart the run") from None
    s = rec.scalars
    clients = {int(cid): Record(unprefixed(rec.tensors, f"client/{cid}/"), sc) for cid, sc in s["clients"].items()}
    if restore_rng:
        torch.set_rng_state(rec.tensors["rng/torch"])
        random.setstate(_tupled(s["rng"]["python"]))
        name, key, pos, has_gauss, cached = s["rng"]["numpy"]
        np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    return Checkpoint(
        s["position"]["next_task"],
        s["position"]["next_round"],
        Record(unprefixed(rec.tensors, "server/"), s["server"]),
        clients,
        s["progress"],
    )


def _numpy_state() -> list:
    name, key, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return [name, key.tolist(), int(pos), int(has_gauss), float(cached)]


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, tuple | list) else x


def _tupled(x: Any) -> Any:
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x
