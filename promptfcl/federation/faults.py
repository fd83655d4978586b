"""Fault injection at the engine boundary: a plan of (client, task, round, attempt) → fault, for tests and drills.

The `Grid` base class looks the plan up for every message it sends. A `no_reply` fault is applied there (the
message is lost: the client never sees it and never answers). Every other fault travels with the message as a
reserved scalar that `run_client` — the client-side entry point every engine shares — removes before the
client program sees the message, then acts on: raise before handling, sleep before handling, or corrupt the
reply after handling (non-finite values; a tensor with the wrong name, shape or dtype). Method code never
changes and never sees the plan; the server sees only what a misbehaving client would send.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from promptfcl.config import FaultSpec
from promptfcl.federation.message import Message

FAULT_KEY = "_promptfcl_fault"
SCHEMA_ERRORS = ("name", "shape", "dtype")


class InjectedFault(RuntimeError):
    """Raised inside a client by a `raise` fault of the plan."""


@dataclass(frozen=True)
class Fault:
    """A fault resolved for one message: its kind and parameters."""

    kind: str
    delay: float = 0.0
    schema_error: str = "shape"

    def to_scalar(self) -> dict[str, Any]:
        return {"kind": self.kind, "delay": self.delay, "schema_error": self.schema_error}

    @classmethod
    def from_scalar(cls, d: dict[str, Any]) -> Fault:
        return cls(str(d["kind"]), float(d.get("delay", 0.0)), str(d.get("schema_error", "shape")))


class FaultPlan:
    """Resolves which fault (if any) hits a client in a (task, round, attempt)."""

    def __init__(self, specs: Sequence[FaultSpec], client_timeout: float | None = None) -> None:
        self.specs = list(specs)
        self.client_timeout = client_timeout

    def __bool__(self) -> bool:
        return bool(self.specs)

    def fault_for(self, task: int, rnd: int, attempt: int, client: int, participants: Sequence[int]) -> Fault | None:
        """The first spec matching this client in this round and attempt, resolved; None when none does."""
        for spec in self.specs:
            if spec.tasks is not None and task not in spec.tasks:
                continue
            if spec.rounds is not None and rnd not in spec.rounds:
                continue
            if spec.attempts is not None and attempt >= spec.attempts:
                continue
            target = spec.client
            if target is None:
                if not participants:
                    continue
                target = sorted(participants)[rnd % len(participants)]
            if target != client:
                continue
            delay = spec.delay if spec.delay is not None else (self.client_timeout or 0.0) + 0.25
            schema = spec.schema_error if spec.schema_error != "cycle" else SCHEMA_ERRORS[rnd % len(SCHEMA_ERRORS)]
            return Fault(spec.kind, delay, schema)
        return None


def pop_fault(message: Message) -> Fault | None:
    """Remove the reserved fault scalar from a delivered message (so the client program never sees it)."""
    raw = message.scalars.pop(FAULT_KEY, None)
    return None if raw is None else Fault.from_scalar(raw)


def run_with_fault(fault: Fault | None, handle: Callable[[], Message]) -> Message:
    """Run a client step under an injected fault: raise, delay, or corrupt its reply."""
    if fault is None:
        return handle()
    if fault.kind == "raise":
        raise InjectedFault("injected fault: the client program raised")
    if fault.kind == "slow":
        time.sleep(fault.delay)
        return handle()
    reply = handle()
    if fault.kind == "nonfinite":
        return make_nonfinite(reply)
    if fault.kind == "bad_schema":
        return break_schema(reply, fault.schema_error)
    raise ValueError(f"fault {fault.kind!r} cannot be applied on the client side")


def _first_float(reply: Message) -> str | None:
    return next((k for k in sorted(reply.tensors) if reply.tensors[k].is_floating_point()), None)


def make_nonfinite(reply: Message) -> Message:
    """NaN in the first element and +inf in the last element of the first floating tensor."""
    name = _first_float(reply)
    if name is not None:
        t = reply.tensors[name].detach().clone()
        flat = t.view(-1)
        flat[0] = float("nan")
        flat[-1] = float("inf")
        reply.tensors[name] = t
    return reply


def break_schema(reply: Message, what: str) -> Message:
    """Rename, reshape (one extra element) or retype (float64 / int32) the first tensor of the reply."""
    name = _first_float(reply) or next(iter(sorted(reply.tensors)), None)
    if name is None:
        return reply
    t = reply.tensors.pop(name)
    if what == "name":
        reply.tensors[name + ".renamed"] = t
    elif what == "shape":
        flat = t.reshape(-1)
        reply.tensors[name] = torch.cat([flat, flat[:1]])
    elif what == "dtype":
        reply.tensors[name] = t.double() if t.dtype != torch.float64 else t.float()
    else:
        raise ValueError(f"unknown schema error {what!r}")
    return reply
