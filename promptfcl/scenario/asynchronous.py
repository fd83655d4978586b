"""Powder / C2Prompt's asynchronous scenario: private task sequences, per-(client, task) slots, async switching.

Follows Powder's benchmark code (piaohongming/Powder `src/fl_main_hard.py`), which C2Prompt declares as its
protocol (`../shared/methods.md` §2.7):

- Task sequences. Every client k has `num_tasks` tasks of C = `classes_per_task` real classes. Tasks are drawn in
  client-major order (ordinal o = k·T + j). Task o = 0 is C random classes. For o > 0 a random earlier ordinal is
  picked and s ~ U{min_overlap, …, C} of its classes are reused, the other C − s drawn from the classes not in
  that task (s = 0: C random classes) — so real classes recur across clients and tasks.
- Output slots. Each (client k, task j) owns C logits of its own: label-space task g = j·K + k (Powder's global
  task id `task_id * num_clients + client_id`), K·T·C logits in all; a real class that recurs gets a new logit
  each time.
- Data slices. Each task uses 1/`data_slices` of every one of its classes' training images: one slice of a fixed
  seeded permutation of the class's images. `slice_rule` picks the slice:
  - `powder` (default): slice o mod `data_slices`, o = k·T + j — Powder's ImageNet-R code
    (`proportion_list[(i·T + j) % 5]`, 20 % slices). With T a multiple of `data_slices` (Powder: T = 5, 5 slices)
    o mod `data_slices` = j, so every client's j-th task uses slice j: a class that recurs at the same position
    of two clients' sequences is trained on the same images, and only repeats at different positions see
    different ones. Powder's DomainNet code uses K·T slices of 2 % (`data_slices` = 50): all distinct.
  - `distinct`: the r-th occurrence of a class over the ordinals (r = 0, 1, …) uses slice r mod `data_slices`,
    so every repeat of a class sees images no earlier occurrence saw, up to `data_slices` occurrences (further
    ones cycle — and a cycled slice may be one another client trained on: with 5 clients × 5 tasks × 10 of 100
    classes a class occurs up to 13 times, and a few hundred images end up trained by two clients).
  - `disjoint`: no image is trained on by two clients. Every client using a class is reserved a fresh slice of it;
    the class's remaining slices go to repeats in occurrence order, and a repeat past them reuses the client's
    own slices in turn (`DisjointSlices`). A class occurring at most `data_slices` times gets exactly its
    `distinct` slices. Needs `data_slices` ≥ the clients using a class (`num_clients` always suffices; otherwise
    a clear error). Used where clients must not share images (per-client domains, `scenario.domains`).
  Default is Powder's rule because C2Prompt declares Powder's benchmark as its protocol.
- Schedule. `num_tasks` stages of `rounds_per_task` rounds. In stage 0 every client trains its task 0. At each
  later stage boundary s a random `switching_clients` (default ⌊K/2⌋) clients switch to task s of their own
  sequence; the others keep training their current task. Clients therefore skip tasks.
- Test set. A label-space task is tested on all (subsampled) test images of its real classes.

Randomness: classes from `numpy_rng(seed, "async_tasks")`, slices from `numpy_rng(seed, "async_slices", class)`,
switching clients from `numpy_rng(seed, "async_switch", stage)` (Powder uses python `random` seeded once).
"""

from __future__ import annotations

import numpy as np

from promptfcl.config import ScenarioConfig
from promptfcl.scenario.common import draw_participants
from promptfcl.scenario.partition import PartitionError
from promptfcl.scenario.scenario import Scenario
from promptfcl.seeding import numpy_rng


def draw_task_sequences(
    num_clients: int, num_tasks: int, per_task: int, num_classes: int, min_overlap: int, rng: np.random.Generator
) -> list[list[list[int]]]:
    """[client][task] → real classes, Powder's overlap generator (client-major order)."""
    seqs: list[list[list[int]]] = [[] for _ in range(num_clients)]
    order = [(k, j) for k in range(num_clients) for j in range(num_tasks)]
    everything = np.arange(num_classes)
    for o, (k, _) in enumerate(order):
        s = 0
        if o > 0:
            src_k, src_j = order[int(rng.integers(o))]
            src = seqs[src_k][src_j]
            s = int(rng.integers(min_overlap, per_task + 1))
        if s == 0:
            classes = rng.choice(num_classes, per_task, replace=False)
        else:
            kept = rng.choice(src, s, replace=False)
            fresh = rng.choice(np.setdiff1d(everything, src), per_task - s, replace=False)
            classes = np.concatenate([kept, fresh])
        seqs[k].append([int(c) for c in classes])
    return seqs


def switch_schedule(num_clients: int, num_stages: int, switching: int, seed: int) -> list[list[int]]:
    """[stage][client] → index in the client's own task sequence."""
    current = [0] * num_clients
    out = [list(current)]
    for s in range(1, num_stages):
        for k in numpy_rng(seed, "async_switch", s).choice(num_clients, switching, replace=False).tolist():
            current[k] = s
        out.append(list(current))
    return out


def slice_indices(seqs: list[list[list[int]]], slices: int, rule: str) -> list[list[int]]:
    """[client][task] → the slice index of each of the task's classes (`rule`: powder | distinct | disjoint)."""
    if rule not in ("powder", "distinct", "disjoint"):
        raise PartitionError(f"unknown scenario.asynchronous.slice_rule {rule!r}; use powder, distinct or disjoint")
    T = len(seqs[0]) if seqs else 0
    seen: dict[int, int] = {}  # class → occurrences so far, in client-major ordinal order
    plan = DisjointSlices(seqs, slices) if rule == "disjoint" else None
    out: list[list[int]] = []
    for k, seq in enumerate(seqs):
        for j, classes in enumerate(seq):
            if rule == "powder":
                out.append([(k * T + j) % slices] * len(classes))
            elif plan is None:
                out.append([seen.get(c, 0) % slices for c in classes])
            else:
                out.append([plan.next(c, k) for c in classes])
            for c in classes:
                seen[c] = seen.get(c, 0) + 1
    return [out[k * T : (k + 1) * T] for k in range(len(seqs))]


class DisjointSlices:
    """`slice_rule: disjoint`: hands out a class's slices so that no two clients hold the same one.

    Every client that uses a class is reserved one fresh slice; the class's other slices go, in occurrence order, to
    repeats (a repeat takes the next fresh slice while more are left than clients still waiting for their first);
    after that a repeat reuses the client's own slices in turn. A class used by more clients than `data_slices` is
    refused, so `data_slices` ≥ `num_clients` always works. Occurrences are visited in client-major order, so a
    class occurring at most `data_slices` times gets the same slices as under `distinct`.
    """

    def __init__(self, seqs: list[list[list[int]]], slices: int) -> None:
        self.slices = slices
        self.users: dict[int, set[int]] = {}
        for k, seq in enumerate(seqs):
            for classes in seq:
                for c in classes:
                    self.users.setdefault(c, set()).add(k)
        for c, users in sorted(self.users.items()):
            if len(users) > slices:
                raise PartitionError(
                    f"slice_rule disjoint: class {c} is used by {len(users)} clients but has only {slices} data "
                    f"slices, so two clients would share images; raise scenario.asynchronous.data_slices to ≥ "
                    f"{len(users)} (num_clients always suffices)"
                )
        self.fresh: dict[int, int] = {}  # class → slices handed out so far (slices 0..fresh-1)
        self.held: dict[tuple[int, int], list[int]] = {}  # (class, client) → its slices, one entry per occurrence

    def next(self, cls: int, client: int) -> int:
        """The slice of `client`'s next occurrence of `cls`."""
        held = self.held.setdefault((cls, client), [])
        fresh = self.fresh.get(cls, 0)
        waiting = sum(1 for k in self.users[cls] if not self.held.get((cls, k)))  # users without a slice yet
        if not held or self.slices - fresh > waiting:
            pick = fresh
            self.fresh[cls] = fresh + 1
        else:
            own = list(dict.fromkeys(held))  # its distinct slices, in the order it got them
            pick = own[(len(held) - len(own)) % len(own)]
        held.append(pick)
        return pick


def class_slice(positions: np.ndarray, slice_index: int, slices: int, rng: np.random.Generator) -> np.ndarray:
    """Slice `slice_index` of `slices` of a seeded permutation of one class's image positions."""
    perm = rng.permutation(positions)
    n = len(perm)
    return perm[slice_index * n // slices : (slice_index + 1) * n // slices]


def build_asynchronous(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    """The asynchronous scenario of `cfg` (kind `asynchronous`) over a dataset's labels."""
    a, K, T = cfg.asynchronous, cfg.num_clients, cfg.num_tasks
    C = cfg.classes_per_task
    if not isinstance(C, int):
        raise PartitionError("an asynchronous scenario needs scenario.classes_per_task as one integer")
    if num_classes < C or a.min_overlap > C:
        raise PartitionError(
            f"classes_per_task {C} / min_overlap {a.min_overlap} do not fit {num_classes} classes "
            "(need min_overlap ≤ classes_per_task ≤ classes)"
        )
    switching = K // 2 if a.switching_clients is None else a.switching_clients
    if switching > K:
        raise PartitionError(f"scenario.asynchronous.switching_clients {switching} > num_clients {K}")
    seqs = draw_task_sequences(K, T, C, num_classes, a.min_overlap, numpy_rng(seed, "async_tasks"))
    positions = {c: np.flatnonzero(train_targets == c) for c in range(num_classes)}
    if min(len(positions[c]) for c in {c for seq in seqs for t in seq for c in t}) < a.data_slices:
        raise PartitionError(
            f"some class has fewer training images than scenario.asynchronous.data_slices ({a.data_slices}); "
            "lower data_slices or raise data.train_per_class"
        )
    slices = slice_indices(seqs, a.data_slices, a.slice_rule)
    task_classes, owners, group_train, test_idx = [], [], [], []
    for j in range(T):  # label-space task g = j·K + k
        for k in range(K):
            classes = seqs[k][j]
            idx = [
                class_slice(positions[c], i, a.data_slices, numpy_rng(seed, "async_slices", c))
                for c, i in zip(classes, slices[k][j], strict=True)
            ]
            task_classes.append(classes)
            owners.append((k, j))
            group_train.append(np.sort(np.concatenate(idx)))
            test_idx.append(np.flatnonzero(np.isin(test_targets, classes)))
    positions_in_seq = switch_schedule(K, T, switching, seed)
    schedule = [[j * K + k for k, j in enumerate(row)] for row in positions_in_seq]
    client_train = [[group_train[g] for g in row] for row in schedule]
    order = sorted({c for t in task_classes for c in t})
    return Scenario(
        seed, num_classes, order, task_classes, client_train, test_idx, draw_participants(cfg, seed), K,
        kind="asynchronous", schedule=schedule, owners=owners,
    )  # fmt: skip
