"""The round's client models that a server step reads many times (HePCo's generator and distillation teachers).

`TeacherStore` keeps them in one of two places:
- `memory`: one model per client on the run's device. On an accelerator that costs device memory, not host
  memory; on a CPU run host memory grows by one model per client.
- `disk`: each client's state goes to a safetensors file in a private temporary folder as its reply arrives, and
  `model(client)` loads it into one shared model when it is used. The host then holds one teacher at a time (the
  files sit in the OS page cache, which the kernel can reclaim), so peak memory does not grow with the number of
  clients. Each load copies one state (about 8 MB for HePCo's paper-size pool on ViT-Tiny): HePCo's server step
  runs 1.13× slower at 5 clients (`benchmarks/results/perf_server_teacher_store.json`).
`auto` picks `memory` on an accelerator and `disk` on the CPU.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn

StoreKind = Literal["auto", "memory", "disk"]


def resolve_store_kind(kind: StoreKind, device: torch.device) -> Literal["memory", "disk"]:
    """`auto` → `memory` on an accelerator (teachers in device memory), `disk` on the CPU."""
    if kind == "auto":
        return "disk" if device.type == "cpu" else "memory"
    return kind


class TeacherStore:
    """Frozen client models for server-side distillation, kept in memory or spilled to disk (see module doc).

    `make_model()` builds an empty model of the method's architecture on the run's device; `add(client, state)`
    stores a client's state (its exchanged tensors); `model(client)` returns an eval-mode, gradient-free model
    holding that state. On disk the returned model is shared: it holds `client`'s state only until the next call.
    """

    def __init__(self, make_model: Callable[[], nn.Module], kind: StoreKind, device: torch.device) -> None:
        self.kind = resolve_store_kind(kind, device)
        self._make = make_model
        self._models: dict[int, nn.Module] = {}
        self._files: dict[int, Path] = {}
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._slot: nn.Module | None = None
        self._loaded: int | None = None

    def __contains__(self, client: int) -> bool:
        return client in self._models or client in self._files

    def __len__(self) -> int:
        return len(self._models) + len(self._files)

    def _frozen(self) -> nn.Module:
        # its random init is overwritten by a client's state: drawn from a forked RNG, so storing teachers never
        # shifts the run's random stream (both kinds, any number of clients, give the same numbers)
        with torch.random.fork_rng(devices=[]):
            m = self._make().eval()
        m.requires_grad_(False)
        return m

    def add(self, client: int, state: dict[str, torch.Tensor]) -> None:
        """Store `client`'s state (a copy on disk; the model's own tensors in memory)."""
        if self.kind == "memory":
            m = self._frozen()
            m.load_state_dict(state, strict=True)
            self._models[client] = m
            return
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="promptfcl-teachers-")
        path = Path(self._folder.name) / f"client{client}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path))
        self._files[client] = path
        if self._loaded == client:
            self._loaded = None

    def model(self, client: int) -> nn.Module:
        """The frozen model holding `client`'s state (on disk: loaded into the shared model if not already)."""
        if self.kind == "memory":
            return self._models[client]
        if self._slot is None:
            self._slot = self._frozen()
        if self._loaded != client:
            self._slot.load_state_dict(load_file(str(self._files[client])), strict=True)
            self._loaded = client
        return self._slot

    def clear(self) -> None:
        """Forget every stored client and delete the files."""
        self._models.clear()
        self._files.clear()
        self._loaded = None
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
