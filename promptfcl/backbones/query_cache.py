"""A content-addressed cache of a frozen function of the input image: the unprompted query q(x) = frozen ViT(x)
without prompts, or the output of a frozen CNN stem (the hybrid backbone's patch embedding).

Pool methods (L2P, DualPrompt, CODA-P, HePCo's weighted pool, FedMGP) need q(x) for every image at every step;
the backbone is frozen, so q is a pure function of the transformed input. The cache keys each sample by a hash
of its exact input tensor: a repeated image under the same deterministic transform (no augmentation, or the
same flip) is a hit across epochs, rounds, clients and evaluation; a randomly cropped image is a new key, so
with `crop_flip` / `rrc_flip` augmentation the cache only costs memory: pool methods' configs turn the query cache
off there, and local training pauses the stem cache (`FrozenViT.stem_cache_paused`).

A function that also depends on frozen-for-now trainable state (FedMGP's global-prompted query V(x'), with the
global prompts frozen for a phase) passes that state's `version` with each call (`state_version`): entries are
kept for one version, and a new one empties the cache, so a new round's prompts are never served stale values.

`per_sample` computes every missing entry from that image alone. Convolutions are not batch-invariant at float
rounding (~2e-5 for the hybrid stem), so a value computed inside a batch depends on which images shared it — and a
run resumed with an empty cache would refill it from other batches than the uninterrupted run did. One image at a
time makes every entry a function of its image alone, so a resumed run is exact (measured on 2 CPU cores: ~1.2× the
batched stem's cost, paid once per image variant).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch


class QueryCache:
    """Maps input-content hashes to the frozen function's output (kept on the CPU), up to `max_entries` entries."""

    def __init__(self, max_entries: int = 500_000, per_sample: bool = False) -> None:
        self.max_entries = max_entries
        self.per_sample = per_sample
        self.store: dict[bytes, torch.Tensor] = {}
        self.version: bytes | None = None
        self.hits = 0
        self.misses = 0

    @staticmethod
    def keys(x: torch.Tensor) -> list[bytes]:
        rows = x.detach().to("cpu", torch.float32).contiguous().numpy()
        return [hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in rows]

    def __call__(
        self, x: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor], version: bytes | None = None
    ) -> torch.Tensor:
        if version != self.version:  # the function changed: nothing stored is valid any more
            self.store.clear()
            self.version = version
        keys = self.keys(x)
        missing = [i for i, k in enumerate(keys) if k not in self.store]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        fresh = {}
        if missing:
            if self.per_sample:
                q = torch.cat([compute(x[i : i + 1]) for i in missing]).detach()
            else:
                q = compute(x[missing]).detach()
            for j, i in enumerate(missing):
                fresh[keys[i]] = q[j]
                if len(self.store) < self.max_entries:
                    self.store[keys[i]] = q[j].to("cpu")
        rows = [fresh[k] if k in fresh else self.store[k].to(x.device) for k in keys]
        return torch.stack(rows)

    def __len__(self) -> int:
        return len(self.store)


def state_version(module: torch.nn.Module, *extra: object) -> bytes:
    """A digest of `module`'s state (every tensor's name, dtype, shape and bytes) and of `extra` values: equal
    digests mean the same frozen function."""
    h = hashlib.blake2b(repr(extra).encode(), digest_size=16)
    for name, t in module.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()
