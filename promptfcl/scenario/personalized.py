"""Personalized FCL scenarios: every client has its own task sequence and its own local test split.

FedMGP (Yu et al., "Personalized Federated Continual Learning via Multi-granularity Prompt", KDD'24, §5.1.1)
defines two settings, both over `num_clients` clients and `num_tasks` tasks:

- **asynchronous**: client k owns `private_classes` classes outright (all their training images; the class
  order's block [k·P, (k+1)·P)); the next `public_classes` classes are public, each public class's images split
  over all clients by Dirichlet(β) (per-class proportions, each image drawn to a client, disjoint); client k's
  P + public classes are shuffled (its own seeded order) into `num_tasks` tasks of equal size (CIFAR-100: 15
  private + 25 public = 40 classes → 5 tasks × 8).
- **synchronous**: `num_tasks` tasks of `classes_per_task` classes in the same order for all clients (CIFAR-100:
  5 × 20), each class's images split over clients by Dirichlet(β), disjoint.

Then each client's data of each task is split 70/30 (`local_test_fraction`) into local train / local test
(official code: `random_split(int(0.7·n), n − int(0.7·n))`); the local test split is read with the
evaluation transform (the official code inherits the training augmentation: not reproduced).

Deviation: the official asynchronous split gives client i ⌊n_c·p_{c,i}⌋ images of public class c (dropping up
to M − 1 images); here every image is assigned to a client drawn from p_c (the project's Dirichlet partitioner,
same expectation, nothing dropped).
"""

from __future__ import annotations

import numpy as np

from promptfcl.config import ScenarioConfig
from promptfcl.scenario.common import class_order, draw_participants, task_class_counts
from promptfcl.scenario.partition import PartitionError, dirichlet_partition
from promptfcl.scenario.scenario import Scenario
from promptfcl.seeding import numpy_rng


def personalized_class_count(cfg: ScenarioConfig, num_classes: int) -> int:
    """Classes the scenario uses; raises `PartitionError` with the fix when the numbers do not fit."""
    p = cfg.personalized
    if p.mode == "synchronous":
        return sum(task_class_counts(cfg, num_classes))
    used = cfg.num_clients * p.private_classes + p.public_classes
    if used > num_classes:
        raise PartitionError(
            f"{cfg.num_clients} clients × {p.private_classes} private + {p.public_classes} public classes = {used} "
            f"> {num_classes} classes; lower scenario.personalized.private_classes or public_classes"
        )
    per_client = p.private_classes + p.public_classes
    if per_client == 0 or per_client % cfg.num_tasks:
        raise PartitionError(
            f"each client's {per_client} classes do not split evenly into {cfg.num_tasks} tasks; change "
            "scenario.num_tasks or scenario.personalized.private_classes / public_classes"
        )
    if cfg.classes_per_task is not None and cfg.classes_per_task != per_client // cfg.num_tasks:
        raise PartitionError(
            f"asynchronous tasks hold (private + public) / num_tasks = {per_client // cfg.num_tasks} classes; "
            "remove scenario.classes_per_task"
        )
    return used


def _split_local_test(idx: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random (train, test) split with int((1 − fraction)·n) training samples (the official `random_split`)."""
    perm = rng.permutation(len(idx))
    n_train = int(len(idx) * (1 - fraction))
    return np.sort(idx[perm[:n_train]]), np.sort(idx[perm[n_train:]])


def build_personalized(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    """A personalized scenario (see the module docstring) as a `Scenario` with `client_tasks` / `client_test`."""
    p, m, T = cfg.personalized, cfg.num_clients, cfg.num_tasks
    used = personalized_class_count(cfg, num_classes)
    order = class_order(cfg, num_classes, seed)[:used]
    # own[k][t] = client k's training-set indices of its task t before the local test split
    if p.mode == "synchronous":
        counts = task_class_counts(cfg, num_classes)
        bounds = np.cumsum([0, *counts])
        tasks = [order[bounds[t] : bounds[t + 1]] for t in range(T)]
        client_tasks = [[list(c) for c in tasks] for _ in range(m)]
        own = [[np.empty(0, dtype=np.int64)] * T for _ in range(m)]
        for t, classes in enumerate(tasks):
            pos = np.flatnonzero(np.isin(train_targets, classes))
            parts = dirichlet_partition(
                train_targets[pos], m, p.beta, numpy_rng(seed, "partition", t), cfg.partition.min_samples,
                cfg.partition.max_retries,
            )  # fmt: skip
            for k in range(m):
                own[k][t] = pos[parts[k]]
    else:
        P = p.private_classes
        private = [order[k * P : (k + 1) * P] for k in range(m)]
        public = order[m * P :]
        pub_pos = np.flatnonzero(np.isin(train_targets, public))
        parts = dirichlet_partition(train_targets[pub_pos], m, p.beta, numpy_rng(seed, "public_split"), 0)
        per_task = (P + len(public)) // T
        client_tasks, own = [], []
        for k in range(m):
            mine = numpy_rng(seed, "client_classes", k).permutation(private[k] + public).tolist()
            client_tasks.append([mine[t * per_task : (t + 1) * per_task] for t in range(T)])
            held = np.sort(np.concatenate([np.flatnonzero(np.isin(train_targets, private[k])), pub_pos[parts[k]]]))
            own.append([held[np.isin(train_targets[held], c)] for c in client_tasks[k]])
    client_train = [[np.empty(0, dtype=np.int64)] * m for _ in range(T)]
    client_test = [[np.empty(0, dtype=np.int64)] * m for _ in range(T)]
    for t in range(T):
        for k in range(m):
            client_train[t][k], client_test[t][k] = _split_local_test(
                own[k][t], p.local_test_fraction, numpy_rng(seed, "local_test", t, k)
            )
    unions = [sorted({c for k in range(m) for c in client_tasks[k][t]}) for t in range(T)]
    test_idx = [np.flatnonzero(np.isin(test_targets, classes)) for classes in unions]
    return Scenario(
        seed, num_classes, order, unions, client_train, test_idx, draw_participants(cfg, seed), m,
        client_tasks=client_tasks, client_test=client_test, kind=f"personalized_{p.mode}",
    )  # fmt: skip
