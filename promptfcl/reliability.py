"""Run-level reliability: stopping cleanly on SIGINT/SIGTERM, and restoring a round's starting state for a retry.

`GracefulStop` turns the first SIGINT/SIGTERM into "finish the round in progress, checkpoint it, then stop"
(the run exits with a `RunInterrupted` that the CLI reports with the resume command); a second signal stops at
once — except while a checkpoint is being written, which always completes first. Either way the run directory
holds a complete checkpoint of the last finished round, so `promptfcl run --resume RUN_DIR` continues exactly.

`RoundSnapshot` is what `Experiment` restores before retrying a round that missed `engine.min_clients`: the
server state, every engine-held client state and the global RNG states, so a retry computes what a first
attempt would have.
"""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch

from promptfcl.federation.message import Record
from promptfcl.federation.protocol import Grid, ServerProgram

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(RuntimeError):
    """A round could not complete (too few usable replies after every retry); the message says what to do."""


class RunInterrupted(BaseException):
    """The run stopped on SIGINT/SIGTERM. A BaseException (like KeyboardInterrupt), so no `except Exception`
    — e.g. the engine's per-client error handling — can swallow it."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop:
    """Signal handling for one run (installed only in the main thread; previous handlers are restored)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}
        self._deferring = False
        self._pending: int | None = None

    def __enter__(self) -> GracefulStop:
        if self.enabled:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = signum
            print(
                f"\n{name}: finishing the round in progress, then stopping with a checkpoint "
                f"(send {name} again to stop now; the last completed round is checkpointed)",
                file=sys.stderr,
                flush=True,
            )
            return
        if self._deferring:
            self._pending = signum
            return
        raise RunInterrupted(signum, f"stopped by {name}; the last completed round is checkpointed")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold back an immediate stop until the block (a checkpoint write) has finished."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None:
            signum, self._pending = self._pending, None
            raise RunInterrupted(signum, f"stopped by {signal.Signals(signum).name}; the checkpoint is complete")

    def check(self, run_dir: Path) -> None:
        """Called between rounds (after the checkpoint): stop now if a signal asked for it."""
        if self.requested is not None:
            name = signal.Signals(self.requested).name
            raise RunInterrupted(
                self.requested,
                f"stopped by {name} after a completed, checkpointed round; continue with "
                f"promptfcl run --resume {run_dir}",
            )


@dataclass
class RoundSnapshot:
    """Server state, engine-held client states and global RNG states at the start of a round."""

    server: Record
    clients: dict[int, Record]
    rng: tuple[torch.Tensor, Any, Any]

    @classmethod
    def take(cls, server: ServerProgram, grid: Grid) -> RoundSnapshot:
        rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        return cls(server.state().copy(), {c: r.copy() for c, r in grid.states.items()}, rng)

    def restore(self, server: ServerProgram, grid: Grid) -> None:
        server.load_state(self.server.copy())
        for c, r in self.clients.items():
            grid.states[c] = r.copy()
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        np.random.set_state(self.rng[2])
