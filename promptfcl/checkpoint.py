"""Checkpoints: one safetensors file (tensors + JSON metadata), written atomically, checksummed, never unpickled.

Layout of `RUN_DIR/checkpoint.safetensors`:
- tensors: `server/<name>`, `client/<id>/<name>`, `rng/torch`;
- metadata JSON: position (next task and round), server and client scalars, run progress (accuracy matrix,
  round log, …), python/numpy RNG states, and `sha256`: a digest of every tensor (name, dtype, shape, bytes)
  and of the scalars' JSON.
Writing: the new file goes to a temporary name and is fsynced; the current checkpoint becomes
`checkpoint.prev.safetensors` (the last two are kept); the temporary file is renamed into place and the directory
fsynced. A crash at any point leaves at least one complete checkpoint. Reading verifies the digest: a truncated
or corrupted file is refused with a clear message and the previous one is used instead (`Checkpoint.note` says
so); if neither verifies, `CheckpointError` says what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file as st_save_file

from promptfcl.federation.message import Record, prefixed, unprefixed

CHECKPOINT_NAME = "checkpoint.safetensors"
PREVIOUS_NAME = "checkpoint.prev.safetensors"


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
    note: str = ""  # set when the latest file was refused and the previous one was used


def atomic_write_bytes(path: Path, data: bytes, keep_previous: Path | None = None) -> None:
    """Write `data` to `path` via a fsynced temporary file and a rename; optionally keep the old file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    _replace(tmp, path, keep_previous)


def atomic_save_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], keep_previous: Path | None = None
) -> None:
    """`atomic_write_bytes` of a safetensors file, written from the tensors' own memory (no bytes copy of the whole
    checkpoint is built, so a checkpoint of many client states costs no second copy of them)."""
    tmp = path.with_name(path.name + ".tmp")
    # safetensors refuses strided tensors (e.g. a channels-last conv weight); contiguous() copies only those
    st_save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    _replace(tmp, path, keep_previous)


def _replace(tmp: Path, path: Path, keep_previous: Path | None) -> None:
    if keep_previous is not None and path.exists():
        os.replace(path, keep_previous)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def digest(tensors: dict[str, torch.Tensor], scalars_json: str) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes (in name order) and the scalars' JSON."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    h.update(scalars_json.encode())
    return h.hexdigest()


def has_checkpoint(run_dir: Path) -> bool:
    """Whether `run_dir` holds a checkpoint (the latest or the previous one)."""
    return (run_dir / CHECKPOINT_NAME).is_file() or (run_dir / PREVIOUS_NAME).is_file()


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
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    text = json.dumps(scalars, sort_keys=True, allow_nan=False)
    metadata = {"scalars": text, "sha256": digest(tensors, text)}
    atomic_save_tensors(run_dir / CHECKPOINT_NAME, tensors, metadata, keep_previous=run_dir / PREVIOUS_NAME)


def verify_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, scalars) of a checkpoint file whose checksum verifies; `CheckpointError` otherwise.

    Files from before checksums were added (no `sha256` entry) are accepted when they parse."""
    try:
        data = path.read_bytes()
        tensors = st_load(data)
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__", {}) or {}
        text = meta["scalars"]
    except Exception as e:  # noqa: BLE001 - any parse failure means a damaged (e.g. truncated) file
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}); it is truncated or damaged") from None
    stored = meta.get("sha256")
    if stored is not None and digest(tensors, text) != stored:
        raise CheckpointError(f"{path} fails its checksum: its contents were altered or partly written")
    try:
        return tensors, json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path} holds unreadable metadata ({e})") from None


def load_checkpoint(run_dir: Path, restore_rng: bool = True) -> Checkpoint:
    """The latest checkpoint that verifies (the previous one when the latest is damaged), RNGs restored."""
    latest, previous = run_dir / CHECKPOINT_NAME, run_dir / PREVIOUS_NAME
    if not latest.is_file() and not previous.is_file():
        raise CheckpointError(f"no checkpoint in {run_dir}: nothing to resume (start the run without --resume)")
    note = ""
    try:
        if not latest.is_file():
            raise CheckpointError(f"{latest} is missing (the run stopped while replacing it)")
        tensors, s = verify_checkpoint(latest)
    except CheckpointError as e:
        if not previous.is_file():
            raise CheckpointError(
                f"{e}; no previous checkpoint to fall back on — delete {run_dir} to restart"
            ) from None
        try:
            tensors, s = verify_checkpoint(previous)
        except CheckpointError as e2:
            raise CheckpointError(
                f"both checkpoints are unusable: {e}; {e2}. Delete {run_dir} to restart the run"
            ) from None
        note = f"refused the latest checkpoint — {e}; resuming from {previous.name}, one round earlier"
    rec = Record(tensors, s)
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
        note,
    )


def _numpy_state() -> list:
    name, key, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return [name, key.tolist(), int(pos), int(has_gauss), float(cached)]


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, tuple | list) else x


def _tupled(x: Any) -> Any:
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x
