"""Evaluates a global model on the test images of every seen task under the scenario's evaluation mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from promptfcl.data.base import ImageSplit
from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import ImageTransform
from promptfcl.scenario.label_space import masked_logits
from promptfcl.scenario.scenario import Scenario


@dataclass
class TaskResult:
    """Accuracy on one task's test images."""

    task: int
    correct: int
    total: int
    class_correct: dict[int, int] | None = None  # real class id → correct (when class groups are reported)
    class_total: dict[int, int] | None = None

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / self.total if self.total else float("nan")


class Evaluator:
    """Class-incremental, task-agnostic evaluation (`regime="task_agnostic"`) or task-aware masking."""

    def __init__(
        self,
        test: ImageSplit,
        scenario: Scenario,
        transform: ImageTransform,
        batch_size: int,
        device: torch.device,
        regime: str = "task_agnostic",
        per_class: bool = False,
    ) -> None:
        self.scenario = scenario
        self.transform = transform
        self.batch_size = nograd_batch(device, batch_size)  # eval.batch_size, or the CPU's no-grad batch
        self.device = device
        self.regime = regime
        self.per_class = per_class  # tally per real class (head/mid/tail accuracy)
        space = scenario.label_space
        self.subsets = [LabeledSubset.of(test, idx, space.class_to_logit) for idx in scenario.test_indices]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, after_task: int) -> list[TaskResult]:
        """Accuracy on tasks 0..after_task."""
        model.eval()
        space = self.scenario.label_space
        results = []
        for task in range(after_task + 1):
            mask = space.eval_mask(task, after_task, self.regime).to(self.device)
            correct = 0
            hits = torch.zeros(space.num_logits, dtype=torch.long)
            seen = torch.zeros(space.num_logits, dtype=torch.long)
            for x, y in self.subsets[task].batches(self.batch_size, self.transform, device=self.device):
                pred = masked_logits(model(x), mask).argmax(dim=1)
                correct += int((pred == y).sum())
                if self.per_class:
                    hits += torch.bincount(y[pred == y].cpu(), minlength=space.num_logits)
                    seen += torch.bincount(y.cpu(), minlength=space.num_logits)
            result = TaskResult(task, correct, len(self.subsets[task]))
            if self.per_class:
                real = {j: c for c, j in enumerate(space.class_to_logit.tolist()) if j >= 0}
                result.class_correct = {real[j]: int(hits[j]) for j in range(space.num_logits) if seen[j]}
                result.class_total = {real[j]: int(seen[j]) for j in range(space.num_logits) if seen[j]}
            results.append(result)
        return results
