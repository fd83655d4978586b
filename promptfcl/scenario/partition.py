"""Client partitioners: split one task's sample indices over clients."""

from __future__ import annotations

import math

import numpy as np


class PartitionError(ValueError):
    """A partition whose constraints cannot be met; the message says which knob to turn."""


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    beta: float,
    rng: np.random.Generator,
    min_samples: int = 0,
    max_retries: int = 10000,
) -> list[np.ndarray]:
    """Per-class Dirichlet split (fed-mammoth "distribution" mode, HGP protocol).

    For each class independently p ~ Dir(β·1_M); each sample of the class goes to a client drawn from p.
    The whole split is redrawn until every client holds at least `min_samples` samples.
    Returns, per client, the sorted positions into `labels`.
    """
    n = len(labels)
    if num_clients * min_samples > n:
        raise PartitionError(
            f"impossible partition: {num_clients} clients × min_samples {min_samples} > {n} samples in the task; "
            "lower scenario.partition.min_samples or scenario.num_clients, or use more data per class"
        )
    classes = np.unique(labels)
    for _ in range(max_retries):
        owner = np.empty(n, dtype=np.int64)
        for c in classes:
            idx = np.flatnonzero(labels == c)
            p = rng.dirichlet(np.full(num_clients, beta))
            owner[idx] = rng.choice(num_clients, size=len(idx), p=p)
        counts = np.bincount(owner, minlength=num_clients)
        if counts.min() >= min_samples:
            return [np.flatnonzero(owner == k) for k in range(num_clients)]
    raise PartitionError(
        f"no Dirichlet(β={beta}) split gave every one of {num_clients} clients ≥ {min_samples} samples in "
        f"{max_retries} draws; raise scenario.partition.beta, lower scenario.partition.min_samples, or raise "
        "scenario.partition.max_retries"
    )


def iid_partition(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, min_samples: int = 0
) -> list[np.ndarray]:
    """A uniform random split into (almost) equal shards."""
    if num_clients * max(min_samples, 1) > len(labels):
        raise PartitionError(
            f"impossible partition: {len(labels)} samples cannot give {num_clients} clients "
            f"{max(min_samples, 1)} each; lower scenario.num_clients"
        )
    perm = rng.permutation(len(labels))
    return [np.sort(part) for part in np.array_split(perm, num_clients)]


def hepco_client_sample(
    labels: np.ndarray,
    rng: np.random.Generator,
    category_ratio: float,
    split_ratio: float,
    imbalance: float,
) -> np.ndarray:
    """One stateless HePCo client's data for one round (HePCo §5.1; code `dataloaders/utils.py`).

    κ (`category_ratio`): keep a random max(1, round(κ·k)) of the task's k classes. γ (`split_ratio`): from each
    kept class draw round(γ·n_c) of its n_c images, independently of other clients (clients may overlap).
    β (`imbalance`): a long-tail profile over the kept classes in a random order, class j keeping
    ⌈γ·n_c·β^(j/(k'−1))⌉ images — **applied to the data** (the official code computes it but never applies it,
    while reporting its counts to the server; `partition.apply_imbalance: false` passes β = 1 here, the code's
    data). Returns sorted positions into `labels`.
    """
    classes = np.unique(labels)
    keep = rng.permutation(classes)[: max(1, round(category_ratio * len(classes)))]
    chosen = []
    for j, c in enumerate(keep):
        pool = np.flatnonzero(labels == c)
        factor = imbalance ** (j / (len(keep) - 1)) if len(keep) > 1 else 1.0
        n = max(1, math.ceil(round(split_ratio * len(pool)) * factor))
        chosen.append(rng.choice(pool, size=min(n, len(pool)), replace=False))
    return np.sort(np.concatenate(chosen))
