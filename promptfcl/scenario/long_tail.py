"""Static federated long-tailed scenarios (CAPT §4.1, App. B; CReFF / FedLoGe protocol).

1. The long-tailed training set, by `scenario.long_tail.profile`:
   - `exponential` (default; CIFAR-10/100-LT, Fashion-MNIST-LT): global exponential long-tail subsampling of the
     training split: class c (natural class order, class 0 the largest) keeps ⌊n_max · IF^(−c/(C−1))⌋ randomly
     chosen images, n_max the smallest per-class count of the (balanced) source split (LDAM / CReFF's
     `imb_factor` = 1/IF).
   - `dataset` (ImageNet-LT, "the standard version from [18]", CAPT §4.1 / App. B): every training image is kept,
     so each class keeps the release's own count (ImageNet-LT: 5–1,280 per class, IF 256); a balanced split is
     refused, as it has no long tail to keep.
2. Per-class Dirichlet(α = `partition.beta`) split of the kept images over the clients (the core partitioner).
3. One task (T = 1) holding every class; participants drawn per round (CAPT: 40 % of 20 clients).
4. Head / mid / tail groups from the sorted class counts of the kept images by cumulative share (75 % / 95 %),
   saved with the scenario; the test split stays as released (balanced for every dataset CAPT uses).
"""

from __future__ import annotations

import numpy as np

from promptfcl.config import ScenarioConfig
from promptfcl.scenario.common import class_order, draw_participants
from promptfcl.scenario.partition import PartitionError, dirichlet_partition, iid_partition
from promptfcl.scenario.scenario import Scenario
from promptfcl.seeding import numpy_rng


def long_tail_counts(n_max: int, num_classes: int, imbalance_factor: float) -> list[int]:
    """n_c = ⌊n_max · IF^(−c/(C−1))⌋, at least 1."""
    if num_classes == 1:
        return [n_max]
    return [max(1, int(n_max * imbalance_factor ** (-c / (num_classes - 1)))) for c in range(num_classes)]


def long_tail_subsample(
    targets: np.ndarray, order: list[int], imbalance_factor: float, rng: np.random.Generator
) -> np.ndarray:
    """Sorted positions of the kept training images; `order[i]` is the class that gets the i-th largest count."""
    per_class = [np.flatnonzero(targets == c) for c in order]
    n_max = min(len(p) for p in per_class)
    if n_max == 0:
        raise PartitionError("a long-tailed scenario needs training images of every class")
    counts = long_tail_counts(n_max, len(order), imbalance_factor)
    kept = [rng.choice(pos, size=n, replace=False) for pos, n in zip(per_class, counts, strict=True)]
    return np.sort(np.concatenate(kept))


def dataset_long_tail(targets: np.ndarray, order: list[int]) -> np.ndarray:
    """Sorted positions of every training image of the classes in `order`: the split's own class counts."""
    counts = np.bincount(targets, minlength=max(order) + 1)[order]
    if counts.min() == 0:
        missing = [c for c, n in zip(order, counts, strict=True) if n == 0][:5]
        raise PartitionError(f"a long-tailed scenario needs training images of every class (none of {missing})")
    if counts.min() == counts.max():
        raise PartitionError(
            f"scenario.long_tail.profile: dataset keeps the training split's own class counts, but every class has "
            f"{counts[0]} images: there is no long tail to keep; use profile: exponential to subsample it"
        )
    return np.flatnonzero(np.isin(targets, order))


def class_groups(counts: dict[int, int], head_share: float = 0.75, mid_share: float = 0.95) -> dict[str, list[int]]:
    """Head / mid / tail by the cumulative share of samples of the classes sorted by count (ties by class id):
    a class is head while the share before it is < head_share, mid while < mid_share, tail after."""
    ranked = sorted(counts, key=lambda c: (-counts[c], c))
    total = sum(counts.values())
    groups: dict[str, list[int]] = {"head": [], "mid": [], "tail": []}
    before = 0
    for c in ranked:
        share = before / total
        groups["head" if share < head_share else "mid" if share < mid_share else "tail"].append(int(c))
        before += counts[c]
    return groups


def build_long_tailed(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    """One static long-tailed task split over clients, with its head/mid/tail class groups."""
    if cfg.num_tasks != 1:
        raise PartitionError("a long_tailed scenario has one task; set scenario.num_tasks: 1")
    if cfg.partition.kind == "hepco":
        raise PartitionError("a long_tailed scenario partitions with dirichlet or iid, not hepco")
    order = class_order(cfg, num_classes, seed)
    if cfg.long_tail.profile == "dataset":
        pos = dataset_long_tail(train_targets, order)
    else:
        pos = long_tail_subsample(train_targets, order, cfg.long_tail.imbalance_factor, numpy_rng(seed, "long_tail"))
    rng = numpy_rng(seed, "partition", 0)
    labels = train_targets[pos]
    p = cfg.partition
    if p.kind == "dirichlet":
        parts = dirichlet_partition(labels, cfg.num_clients, p.beta, rng, p.min_samples, p.max_retries)
    else:
        parts = iid_partition(labels, cfg.num_clients, rng, p.min_samples)
    counts = {c: int((labels == c).sum()) for c in order}
    groups = class_groups(counts, cfg.long_tail.head_share, cfg.long_tail.mid_share)
    test_idx = np.flatnonzero(np.isin(test_targets, order))
    return Scenario(
        seed,
        num_classes,
        order,
        [order],
        [[pos[q] for q in parts]],
        [test_idx],
        draw_participants(cfg, seed),
        cfg.num_clients,
        groups,
    )
