"""Scenarios as saved data: class order, tasks, per-client per-task indices, participation, seed.

A scenario is built deterministically from (dataset labels, scenario config, seed), written to
`scenario.json` with every run, and can be reloaded from that file. Everything downstream (clients,
evaluator, engines) reads indices from it; nothing re-draws a partition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from promptfcl.data.domains import ImageDomain
from promptfcl.scenario.label_space import LabelSpace


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
