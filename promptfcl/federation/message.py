"""Messages and states: named tensors plus JSON scalars, byte-counted, serialisable without pickle.

A `Record` is the one container that crosses every boundary — server ↔ client messages, persistent client
state, server state, checkpoints. It maps 1:1 onto Flower's `ArrayRecord` (tensors) + `ConfigRecord`
(scalars), and serialises to safetensors bytes with the scalars as JSON metadata.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def _check_json(scalars: dict[str, Any]) -> str:
    try:
        return json.dumps(scalars, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"message scalars must be JSON values (no NaN/inf): {e}") from None


@dataclass
class Record:
    """Named tensors + JSON scalars."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, t in self.tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError(f"record tensor {name!r} must be a torch.Tensor under a string name")

    def tensor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def nbytes(self) -> int:
        """Payload size: raw tensor bytes plus the UTF-8 JSON of the scalars."""
        return self.tensor_bytes() + len(_check_json(self.scalars).encode())

    def copy(self) -> Record:
        return type(self)(**self._copied_fields())

    def _copied_fields(self) -> dict[str, Any]:
        return {
            "tensors": {k: v.detach().clone() for k, v in self.tensors.items()},
            "scalars": copy.deepcopy(self.scalars),
        }

    def to_bytes(self) -> bytes:
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}
        return st_save(tensors, metadata={"scalars": _check_json(self.scalars), **self._extra_meta()})

    def _extra_meta(self) -> dict[str, str]:
        return {}

    @classmethod
    def from_bytes(cls, data: bytes) -> Record:
        tensors = st_load(data)
        meta = _read_metadata(data)
        return cls._from_parts(tensors, json.loads(meta.get("scalars", "{}")), meta)

    @classmethod
    def _from_parts(cls, tensors: dict[str, torch.Tensor], scalars: dict[str, Any], meta: dict[str, str]) -> Record:
        return cls(tensors, scalars)


def _read_metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return header.get("__metadata__", {}) or {}


@dataclass
class Message(Record):
    """A `Record` with a kind (the action, e.g. "train", "stats", "train_reply")."""

    kind: str = ""

    def _copied_fields(self) -> dict[str, Any]:
        return {**super()._copied_fields(), "kind": self.kind}

    def nbytes(self) -> int:
        return super().nbytes() + len(self.kind.encode())

    def _extra_meta(self) -> dict[str, str]:
        return {"kind": self.kind}

    @classmethod
    def _from_parts(cls, tensors: dict[str, torch.Tensor], scalars: dict[str, Any], meta: dict[str, str]) -> Message:
        return cls(tensors, scalars, kind=meta.get("kind", ""))


def prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """{prefix + name: tensor} — for packing several tensor groups into one record."""
    return {prefix + k: v for k, v in tensors.items()}


def unprefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose names start with `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
