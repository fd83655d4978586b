"""Reply validation: what a server accepts from a client before any of it touches the global model.

Every reply is checked by the `Grid` base class, for every engine: its scalars must be JSON values without
NaN/inf, every floating tensor must be finite, and its tensors must match what the server expects — a
`ReplySchema` the server program derives from its model's state (names, shapes, dtypes) plus the statistics it
declares (e.g. `stats/means` of shape (C, d) with the same C as `stats/classes`). Without a schema, tensors that
share a name with the message the server sent must keep its shape and dtype.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from promptfcl.federation.message import Message

Dim = int | str | None  # exact size | a symbol bound to one size within a reply | any size


@dataclass(frozen=True)
class TensorSpec:
    """Expected dtype and shape of one tensor (and optional bounds on its values, for ids and counts)."""

    shape: tuple[Dim, ...]
    dtype: torch.dtype
    low: float | None = None
    high: float | None = None

    @classmethod
    def like(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), t.dtype)


@dataclass
class ReplySchema:
    """What a reply must carry: required tensors, all-or-none optional groups, typed scalars.

    `closed=True` also rejects tensor names the schema does not list.
    """

    required: dict[str, TensorSpec] = field(default_factory=dict)
    groups: list[dict[str, TensorSpec]] = field(default_factory=list)
    scalars: dict[str, tuple[type, ...]] = field(default_factory=dict)
    closed: bool = False

    def check(self, reply: Message) -> list[str]:
        """Every problem found (empty when the reply conforms)."""
        problems: list[str] = []
        bound: dict[str, int] = {}
        for name, spec in self.required.items():
            if name not in reply.tensors:
                problems.append(f"missing tensor {name!r}")
            else:
                problems += _check_tensor(name, reply.tensors[name], spec, bound)
        known = set(self.required)
        for group in self.groups:
            known |= set(group)
            present = [n for n in group if n in reply.tensors]
            if present and len(present) != len(group):
                missing = sorted(set(group) - set(present))
                problems.append(f"incomplete tensor group: has {present}, missing {missing}")
            for name in present:
                problems += _check_tensor(name, reply.tensors[name], group[name], bound)
        if self.closed:
            problems += [f"unexpected tensor {n!r}" for n in sorted(set(reply.tensors) - known)]
        for name, types in self.scalars.items():
            v = reply.scalars.get(name)
            if v is None or isinstance(v, bool) or not isinstance(v, types):
                problems.append(f"scalar {name!r} must be {'/'.join(t.__name__ for t in types)}, got {v!r}")
        return problems


def _check_tensor(name: str, t: torch.Tensor, spec: TensorSpec, bound: dict[str, int]) -> list[str]:
    if not isinstance(t, torch.Tensor):
        return [f"{name!r} is a {type(t).__name__}, not a tensor"]
    if t.dtype != spec.dtype:
        return [f"tensor {name!r} has dtype {t.dtype}, expected {spec.dtype}"]
    if t.dim() != len(spec.shape) or any(not _dim_ok(s, e, bound) for s, e in zip(t.shape, spec.shape, strict=True)):
        want = tuple("*" if e is None else e for e in spec.shape)
        return [f"tensor {name!r} has shape {tuple(t.shape)}, expected {want}"]
    if t.numel() and (spec.low is not None or spec.high is not None):
        lo, hi = t.min().item(), t.max().item()
        if (spec.low is not None and lo < spec.low) or (spec.high is not None and hi > spec.high):
            return [f"tensor {name!r} has values in [{lo}, {hi}], expected within [{spec.low}, {spec.high}]"]
    return []


def _dim_ok(size: int, expected: Dim, bound: dict[str, int]) -> bool:
    if expected is None:
        return True
    if isinstance(expected, int):
        return size == expected
    return bound.setdefault(expected, size) == size


def check_scalars(reply: Message) -> tuple[str, str] | None:
    """(kind, reason) when the scalars are not JSON values or hold NaN/inf; None when they are fine."""
    try:
        json.dumps(reply.scalars, allow_nan=False)
    except ValueError as e:
        bad = [k for k, v in reply.scalars.items() if isinstance(v, float) and not math.isfinite(v)]
        return "nonfinite", f"non-finite scalar(s) {bad or ''} ({e})"
    except TypeError as e:
        return "schema", f"scalars are not JSON values: {e}"
    return None


def nonfinite_tensors(reply: Message) -> list[str]:
    """Descriptions of the floating tensors holding NaN or inf."""
    out = []
    for name, t in sorted(reply.tensors.items()):
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                out.append(f"tensor {name!r} has {bad} non-finite value(s)")
    return out


def check_against_sent(reply: Message, sent: Mapping[str, torch.Tensor]) -> list[str]:
    """Without a schema: tensors the server sent that come back must keep their shape and dtype."""
    problems = []
    for name, t in reply.tensors.items():
        ref = sent.get(name)
        if ref is not None and isinstance(t, torch.Tensor) and (t.shape != ref.shape or t.dtype != ref.dtype):
            problems.append(
                f"tensor {name!r} came back as {tuple(t.shape)} {t.dtype}, sent as {tuple(ref.shape)} {ref.dtype}"
            )
    return problems
