"""Scenarios as saved data: class order, tasks, per-client per-task indices, participation, seed.

A scenario is built deterministically from (dataset labels, scenario config, seed), written to
`scenario.json` with every run, and can be reloaded from that file. Everything downstream (clients,
evaluator, engines) reads indices from it; nothing re-draws a partition.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from promptfcl.config import ScenarioConfig
from promptfcl.data.domains import ImageDomain, draw_domains
from promptfcl.scenario.label_space import LabelSpace
from promptfcl.scenario.partition import PartitionError, dirichlet_partition, hepco_client_sample, iid_partition
from promptfcl.seeding import numpy_rng


@dataclass
class Scenario:
    """Tasks × clients × rounds, as indices into a dataset's train and test splits.

    The run loop's "task" index is a *stage*: `client_train` and `participants` are indexed by stage.
    `task_classes` and `test_indices` are indexed by *label-space task* (a group of logit slots). In a
    class-incremental scenario both are the same global task. In an asynchronous one (`schedule` set) each
    label-space task is one (client, client-task) pair (`owners`), and `schedule[stage][client]` names the
    label-space task the client trains in that stage.
    """

    seed: int
    num_classes: int
    class_order: list[int]
    task_classes: list[list[int]]  # [label-space task] → real classes (slot order)
    client_train: list[list[np.ndarray]]  # [stage][client] → train indices
    test_indices: list[np.ndarray]  # [label-space task] → test indices
    participants: list[list[list[int]]]  # [stage][round] → client ids
    num_clients: int
    class_groups: dict[str, list[int]] | None = None  # long-tailed: "head"/"mid"/"tail" → real class ids
    kind: str = "class_incremental"
    schedule: list[list[int]] | None = None  # [stage][client] → label-space task (asynchronous only)
    owners: list[tuple[int, int]] | None = None  # [label-space task] → (client, index in its sequence)
    # personalized scenarios only (None otherwise): [client][task] → that client's classes, and
    # [task][client] → its local test indices (into the *train* split, held out from `client_train`)
    client_tasks: list[list[list[int]]] | None = None
    client_test: list[list[np.ndarray]] | None = None
    upper_bound: str | None = None  # "centralized" | "joint": one learner, no federation (scenario.upper_bound)
    # [client] → its fixed image domain (scenario.domains; None: every client sees the images as they are)
    domains: list[ImageDomain] | None = None

    @property
    def personalized(self) -> bool:
        return self.client_tasks is not None

    @property
    def num_tasks(self) -> int:
        """Stages of the run loop (= tasks in a class-incremental scenario)."""
        return len(self.participants)

    @property
    def rounds_per_task(self) -> int:
        return len(self.participants[0])

    @cached_property
    def label_space(self) -> LabelSpace:
        if self.personalized:  # fixed mapping: tasks are the per-task unions over clients and may share classes
            return LabelSpace(self.task_classes, self.num_classes, class_order=self.class_order)
        return LabelSpace(self.task_classes, self.num_classes, allow_repeats=self.schedule is not None)

    def label_task(self, stage: int, client: int) -> int:
        """The label-space task `client` trains in `stage`."""
        return stage if self.schedule is None else self.schedule[stage][client]

    def trained_label_tasks(self, stage: int) -> list[int]:
        """Label-space tasks trained in stages 0..stage (sorted)."""
        if self.schedule is None:
            return list(range(stage + 1))
        return sorted({g for row in self.schedule[: stage + 1] for g in row})

    def finished_label_tasks(self, stage: int) -> list[int]:
        """Label-space tasks whose training ends with `stage` (their client moves on, or the run ends)."""
        if self.schedule is None:
            return [stage]
        last = stage == len(self.schedule) - 1
        return sorted({g for k, g in enumerate(self.schedule[stage]) if last or self.schedule[stage + 1][k] != g})

    def client_label_space(self, client: int) -> LabelSpace:
        """The label space a client trains and is evaluated in (its own task sequence when personalized)."""
        if self.client_tasks is None:
            return self.label_space
        return self.label_space.view(self.client_tasks[client])

    def client_test_indices(self, task: int, client: int) -> np.ndarray | None:
        """The client's local test indices (train split) of `task`, or None when the scenario has none."""
        return None if self.client_test is None else self.client_test[task][client]

    def client_domain(self, client: int) -> ImageDomain | None:
        """The image domain of `client`'s training images and of its own (client, task) test images (None: none)."""
        if self.domains is None or not self.domains[client].steps:
            return None
        return self.domains[client]

    def client_indices(self, task: int, client: int) -> np.ndarray:
        return self.client_train[task][client]

    def client_class_counts(self, train_targets: np.ndarray) -> np.ndarray:
        """(clients, classes in class order) training samples each client holds over the run (each sample once)."""
        pos = {c: i for i, c in enumerate(self.class_order)}
        counts = np.zeros((self.num_clients, len(self.class_order)), dtype=np.int64)
        for k in range(self.num_clients):
            idx = np.unique(np.concatenate([task[k] for task in self.client_train] or [np.zeros(0, np.int64)]))
            for c, n in zip(*np.unique(train_targets[idx], return_counts=True), strict=True):
                counts[k, pos[int(c)]] += n
        return counts

    def client_task_matrix(self) -> np.ndarray:
        """(clients, classes in class order): 1 + the task in which the client learns the class, 0 if never."""
        pos = {c: i for i, c in enumerate(self.class_order)}
        out = np.zeros((self.num_clients, len(self.class_order)), dtype=np.int64)
        for k in range(self.num_clients):
            tasks = self.client_tasks[k] if self.client_tasks is not None else self.task_classes
            for t, classes in enumerate(tasks):
                for c in classes:
                    out[k, pos[c]] = t + 1
        return out

    def to_json(self, train_targets: np.ndarray | None = None) -> dict:
        out = {
            "seed": self.seed,
            "num_classes": self.num_classes,
            "num_clients": self.num_clients,
            "class_order": self.class_order,
            "task_classes": self.task_classes,
            "participants": self.participants,
            "client_train": [[idx.tolist() for idx in task] for task in self.client_train],
            "test_indices": [idx.tolist() for idx in self.test_indices],
            "client_task_counts": [[len(idx) for idx in task] for task in self.client_train],
        }
        if self.personalized:
            out["kind"] = self.kind
            out["client_tasks"] = self.client_tasks
            out["client_test"] = [[idx.tolist() for idx in task] for task in self.client_test or []]
            out["client_task_test_counts"] = [[len(idx) for idx in task] for task in self.client_test or []]
        if train_targets is not None:
            out["client_class_counts"] = self.client_class_counts(train_targets).tolist()
        if self.class_groups is not None:
            out["class_groups"] = self.class_groups
        if self.upper_bound is not None:
            out["upper_bound"] = self.upper_bound
        if self.domains is not None:
            out["client_domains"] = [d.to_json() for d in self.domains]
        if self.schedule is not None:
            out.update(kind=self.kind, schedule=self.schedule, owners=[list(o) for o in self.owners or []])
        return out

    @classmethod
    def from_json(cls, d: dict) -> Scenario:
        return cls(
            seed=d["seed"],
            num_classes=d["num_classes"],
            class_order=list(d["class_order"]),
            task_classes=[list(t) for t in d["task_classes"]],
            client_train=[[np.asarray(i, dtype=np.int64) for i in task] for task in d["client_train"]],
            test_indices=[np.asarray(i, dtype=np.int64) for i in d["test_indices"]],
            participants=d["participants"],
            num_clients=d["num_clients"],
            class_groups=d.get("class_groups"),
            kind=d.get("kind", "class_incremental"),
            schedule=d.get("schedule"),
            owners=[(int(a), int(b)) for a, b in d["owners"]] if d.get("owners") else None,
            client_tasks=d.get("client_tasks"),
            client_test=(
                [[np.asarray(i, dtype=np.int64) for i in task] for task in d["client_test"]]
                if d.get("client_test") is not None
                else None
            ),
            upper_bound=d.get("upper_bound"),
            domains=[ImageDomain.from_json(x) for x in d["client_domains"]] if d.get("client_domains") else None,
        )

    def save(self, path: Path, train_targets: np.ndarray | None = None) -> None:
        path.write_text(json.dumps(self.to_json(train_targets)))

    @classmethod
    def load(cls, path: Path) -> Scenario:
        return cls.from_json(json.loads(path.read_text()))


def task_class_counts(cfg: ScenarioConfig, num_classes: int) -> list[int]:
    """Classes in each task, checked against the dataset's class count."""
    cpt = cfg.classes_per_task
    if cfg.kind == "asynchronous":
        if not isinstance(cpt, int) or cpt > num_classes:
            raise PartitionError(
                "an asynchronous scenario needs scenario.classes_per_task as one integer ≤ the dataset's "
                f"{num_classes} classes"
            )
        return [cpt] * cfg.num_tasks
    if cpt is None:
        if num_classes % cfg.num_tasks:
            raise PartitionError(
                f"{num_classes} classes do not split evenly into {cfg.num_tasks} tasks; set scenario.classes_per_task"
            )
        counts = [num_classes // cfg.num_tasks] * cfg.num_tasks
    elif isinstance(cpt, int):
        counts = [cpt] * cfg.num_tasks
    else:
        counts = list(cpt)
        if len(counts) != cfg.num_tasks:
            raise PartitionError(
                f"scenario.classes_per_task lists {len(counts)} tasks but num_tasks is {cfg.num_tasks}; give one "
                "count per task or set scenario.num_tasks to the list's length"
            )
    if sum(counts) > num_classes:
        raise PartitionError(
            f"tasks need {sum(counts)} classes but the dataset has {num_classes}; lower "
            "scenario.num_tasks or scenario.classes_per_task"
        )
    return counts


def class_order(cfg: ScenarioConfig, num_classes: int, seed: int) -> list[int]:
    if isinstance(cfg.class_order, list):
        order = list(cfg.class_order)
        if sorted(order) != sorted(set(order)) or any(not 0 <= c < num_classes for c in order):
            raise PartitionError(
                f"scenario.class_order must list distinct class ids in [0, {num_classes}); remove duplicates and "
                "out-of-range ids"
            )
        return order
    if cfg.class_order == "shuffled":
        return numpy_rng(seed, "class_order").permutation(num_classes).tolist()
    return list(range(num_classes))


def draw_participants(cfg: ScenarioConfig, seed: int) -> list[list[list[int]]]:
    m = cfg.num_clients
    k = max(1, math.ceil(cfg.participation.fraction * m))
    out = []
    for t in range(cfg.num_tasks):
        if cfg.participation.mode == "per_task":
            chosen = sorted(numpy_rng(seed, "participants", t).choice(m, size=k, replace=False).tolist())
            out.append([chosen] * cfg.rounds_per_task)
        else:
            out.append(
                [
                    sorted(numpy_rng(seed, "participants", t, r).choice(m, size=k, replace=False).tolist())
                    for r in range(cfg.rounds_per_task)
                ]
            )
    return out


def build_scenario(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    """The scenario family `cfg.kind` names (the one dispatch point for scenario builders), in its centralized or
    joint upper-bound form when `cfg.upper_bound` is set (`promptfcl.scenario.upper_bound`), with each client's
    image domain when `cfg.domains` is set (`promptfcl.data.domains`)."""
    scenario = _build_family(cfg, train_targets, test_targets, num_classes, seed)
    if cfg.domains is not None:
        scenario.domains = draw_domains(cfg.domains, scenario.num_clients, seed)
    return scenario


def _build_family(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    if cfg.upper_bound is not None:
        from promptfcl.scenario.upper_bound import upper_bound_scenario

        federated = build_scenario(
            cfg.model_copy(update={"upper_bound": None}), train_targets, test_targets, num_classes, seed
        )
        return upper_bound_scenario(federated, cfg, cfg.upper_bound)
    if cfg.kind == "asynchronous":
        from promptfcl.scenario.asynchronous import build_asynchronous

        return build_asynchronous(cfg, train_targets, test_targets, num_classes, seed)
    if cfg.kind == "long_tailed":
        from promptfcl.scenario.long_tail import build_long_tailed

        return build_long_tailed(cfg, train_targets, test_targets, num_classes, seed)
    if cfg.kind == "personalized":
        from promptfcl.scenario.personalized import build_personalized

        return build_personalized(cfg, train_targets, test_targets, num_classes, seed)
    return build_class_incremental(cfg, train_targets, test_targets, num_classes, seed)


def build_class_incremental(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    """Class-incremental scenario: disjoint class sets per task, each task's samples split over clients."""
    counts = task_class_counts(cfg, num_classes)
    order = class_order(cfg, num_classes, seed)
    tasks, offset = [], 0
    for n in counts:
        tasks.append(order[offset : offset + n])
        offset += n
    if cfg.partition.kind == "hepco":
        return _stateless_rounds(cfg, train_targets, test_targets, num_classes, seed, order[:offset], tasks)
    client_train, test_idx = [], []
    for t, classes in enumerate(tasks):
        pos = np.flatnonzero(np.isin(train_targets, classes))
        rng = numpy_rng(seed, "partition", t)
        if cfg.partition.kind == "dirichlet":
            parts = dirichlet_partition(
                train_targets[pos],
                cfg.num_clients,
                cfg.partition.beta,
                rng,
                cfg.partition.min_samples,
                cfg.partition.max_retries,
            )
        else:
            parts = iid_partition(train_targets[pos], cfg.num_clients, rng, cfg.partition.min_samples)
        client_train.append([pos[p] for p in parts])
        test_idx.append(np.flatnonzero(np.isin(test_targets, classes)))
    return Scenario(
        seed, num_classes, order[:offset], tasks, client_train, test_idx, draw_participants(cfg, seed), cfg.num_clients
    )


def _stateless_rounds(
    cfg: ScenarioConfig,
    train_targets: np.ndarray,
    test_targets: np.ndarray,
    num_classes: int,
    seed: int,
    order: list[int],
    tasks: list[list[int]],
) -> Scenario:
    """HePCo: `num_clients` fresh clients per round; client slot r·K + k is round r's k-th client of every task."""
    k, rounds = cfg.num_clients, cfg.rounds_per_task
    p = cfg.partition
    client_train, test_idx = [], []
    for t, classes in enumerate(tasks):
        pos = np.flatnonzero(np.isin(train_targets, classes))
        client_train.append(
            [
                pos[
                    hepco_client_sample(
                        train_targets[pos],
                        numpy_rng(seed, "hepco", t, slot),
                        p.category_ratio,
                        p.split_ratio,
                        p.imbalance,
                    )
                ]
                for slot in range(rounds * k)
            ]
        )
        test_idx.append(np.flatnonzero(np.isin(test_targets, classes)))
    participants = [[list(range(r * k, (r + 1) * k)) for r in range(rounds)] for _ in tasks]
    return Scenario(seed, num_classes, order, tasks, client_train, test_idx, participants, rounds * k)
