"""Deterministic randomness: every random draw is a pure function of (seed, purpose, task, round, client).

Deriving a fresh generator per unit of work (instead of threading one global RNG through the run) makes
runs reproducible, makes `--resume` bit-exact without replaying history, and makes the in-process and
Flower engines draw the same numbers for the same client in the same round.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def derive_seed(seed: int, *keys: object) -> int:
    """A 63-bit seed from a base seed and any number of keys (strings or ints)."""
    text = "/".join([str(int(seed))] + [str(k) for k in keys])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def torch_generator(seed: int, *keys: object) -> torch.Generator:
    """A CPU torch generator seeded from `derive_seed(seed, *keys)`."""
    gen = torch.Generator()
    gen.manual_seed(derive_seed(seed, *keys))
    return gen


def numpy_rng(seed: int, *keys: object) -> np.random.Generator:
    """A numpy generator seeded from `derive_seed(seed, *keys)`."""
    return np.random.default_rng(derive_seed(seed, *keys))


def seed_everything(seed: int, *keys: object) -> None:
    """Seed the global torch / numpy / random RNGs, for code that draws from them implicitly."""
    s = derive_seed(seed, *keys)
    torch.manual_seed(s)
    np.random.seed(s % (2**32))
    random.seed(s)
