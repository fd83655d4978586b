"""Label spaces and evaluation masks: which real class maps to which logit, and which logits compete.

A `LabelSpace` owns the mapping real class id → logit index and the logit slots of each task. Masks are
computed from it, so the same model code serves class-incremental (all seen logits compete), task-aware
(only the task's own logits) and per-(client, task) slot regimes.

Personalized scenarios (per-client task sequences) use a *fixed* mapping: logit i is `class_order[i]` for every
client, tasks may then share classes (the run-level space lists each task's union over clients), and each
client gets a `view` with its own task sequence over the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

TrainLogits = Literal["current_task", "seen", "all"]  # the task's logits, every seen task's, or every logit


@dataclass(frozen=True)
class Task:
    """One task: its real classes and the logit slots they map to (same order)."""

    index: int
    classes: tuple[int, ...]
    logits: tuple[int, ...]


class LabelSpace:
    """Real class → logit mapping and per-task logit slots for a sequence of tasks.

    With `allow_repeats` (Powder/C2Prompt's per-(client, task) slots) a real class may belong to several tasks,
    each time under its own logit; the mapping is then per task (`task_class_to_logit`) and the global
    `class_to_logit` refuses to answer.
    """

    def __init__(
        self,
        tasks: list[list[int]],
        num_real_classes: int,
        allow_repeats: bool = False,
        class_order: list[int] | None = None,
    ) -> None:
        self.tasks: list[Task] = []
        self.num_real_classes = num_real_classes
        self.repeats = False
        self._class_to_logit = torch.full((num_real_classes,), -1, dtype=torch.long)
        self.fixed = class_order is not None
        if class_order is not None:  # personalized: logit i is class_order[i], tasks may share classes
            self.class_order = list(class_order)
            self._class_to_logit[torch.tensor(self.class_order, dtype=torch.long)] = torch.arange(len(class_order))
            for t, classes in enumerate(tasks):
                logits = tuple(int(self._class_to_logit[c]) for c in classes)
                if any(j < 0 for j in logits):
                    raise ValueError(f"task {t} holds a class outside the class order")
                self.tasks.append(Task(t, tuple(classes), logits))
            self.num_logits = len(class_order)
            return
        offset = 0
        for t, classes in enumerate(tasks):
            if len(set(classes)) != len(classes):
                raise ValueError(f"task {t} lists a class twice")
            logits = tuple(range(offset, offset + len(classes)))
            for c, j in zip(classes, logits, strict=True):
                if self._class_to_logit[c] >= 0:
                    if not allow_repeats:
                        raise ValueError(f"class {c} appears in two tasks")
                    self.repeats = True
                    continue
                self._class_to_logit[c] = j
            self.tasks.append(Task(t, tuple(classes), logits))
            offset += len(classes)
        self.num_logits = offset

    @property
    def class_to_logit(self) -> torch.Tensor:
        """The one logit of every real class (-1: in no task); only defined when no class repeats."""
        if self.repeats:
            raise ValueError("real classes repeat across tasks in this label space; use task_class_to_logit(task)")
        return self._class_to_logit

    def task_class_to_logit(self, task: int) -> torch.Tensor:
        """(real classes,) → logit map of one task's classes (-1 elsewhere)."""
        out = torch.full((self.num_real_classes,), -1, dtype=torch.long)
        t = self.tasks[task]
        out[list(t.classes)] = torch.tensor(t.logits, dtype=torch.long)
        return out

    def logit_to_class(self) -> torch.Tensor:
        """(logits,) → the real class each logit stands for."""
        out = torch.empty(self.num_logits, dtype=torch.long)
        for t in self.tasks:
            out[list(t.logits)] = torch.tensor(t.classes, dtype=torch.long)
        return out

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def to_logits(self, real_targets: torch.Tensor) -> torch.Tensor:
        out = self.class_to_logit[real_targets]  # raises for repeating label spaces
        if (out < 0).any():
            raise ValueError("a target belongs to no task of this label space")
        return out

    def seen_logits(self, task: int) -> int:
        """Number of logits of tasks 0..task (class-incremental slots are contiguous)."""
        if self.fixed:
            raise ValueError("a personalized label space has no contiguous seen-logit range; use seen_mask")
        t = self.tasks[task]
        return t.logits[-1] + 1

    def seen_mask(self, task: int) -> torch.Tensor:
        """Bool mask of the logits of tasks 0..task."""
        return self.mask(sorted({j for t in self.tasks[: task + 1] for j in t.logits}))

    def view(self, tasks: list[list[int]]) -> LabelSpace:
        """The same fixed class → logit mapping with another task sequence (one client's, in a personalized run)."""
        if not self.fixed:
            raise ValueError("only a fixed-mapping (personalized) label space has per-client views")
        return LabelSpace(tasks, self.num_real_classes, class_order=self.class_order)

    def mask(self, logits: list[int] | tuple[int, ...] | range) -> torch.Tensor:
        m = torch.zeros(self.num_logits, dtype=torch.bool)
        m[list(logits)] = True
        return m

    def train_mask(self, task: int, which: TrainLogits) -> torch.Tensor:
        """Logits that compete in local training on `task`."""
        if which == "current_task":
            return self.mask(self.tasks[task].logits)
        if which == "all":  # future tasks' logits compete too
            return torch.ones(self.num_logits, dtype=torch.bool)
        return self.seen_mask(task)

    def eval_mask(self, evaluated_task: int, after_task: int, regime: str = "task_agnostic") -> torch.Tensor:
        """Logits that compete when testing `evaluated_task` after training `after_task`."""
        if regime == "task_agnostic":
            return self.seen_mask(after_task)
        if regime in ("task_aware", "client_local"):
            return self.mask(self.tasks[evaluated_task].logits)
        raise ValueError(f"unknown evaluation regime {regime!r}")


def masked_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits with masked-out entries set to -inf (mask broadcast over the batch)."""
    return logits.masked_fill(~mask.to(logits.device), float("-inf"))
