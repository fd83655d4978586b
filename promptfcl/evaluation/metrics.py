"""Continual-learning metrics from an accuracy matrix.

`A[t][i]` is the accuracy (in %) on task i after training task t, defined for i ≤ t. Definitions:
- FAA (final average accuracy) = mean_i A[T-1][i] (HGP's FAA, HePCo's A_N);
- average accuracy after task t = mean_{i≤t} A[t][i] (the "accuracy after each task" curve);
- average forgetting = mean_{i<T-1} (max_{t<T-1} A[t][i] − A[T-1][i]) (Chaudhry et al., 2018);
- BWT = mean_{i<T-1} (A[T-1][i] − A[i][i]) (Lopez-Paz & Ranzato, 2017).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Matrix = Sequence[Sequence[float]]


def _check(A: Matrix) -> int:
    T = len(A)
    for t, row in enumerate(A):
        if len(row) < t + 1:
            raise ValueError(f"row {t} of the accuracy matrix needs {t + 1} entries, has {len(row)}")
    return T


def average_accuracy(A: Matrix, t: int) -> float:
    return sum(A[t][: t + 1]) / (t + 1)


def accuracy_curve(A: Matrix) -> list[float]:
    return [average_accuracy(A, t) for t in range(_check(A))]


def final_average_accuracy(A: Matrix) -> float:
    T = _check(A)
    return average_accuracy(A, T - 1) if T else math.nan


def average_forgetting(A: Matrix) -> float:
    T = _check(A)
    if T < 2:
        return 0.0
    drops = [max(A[t][i] for t in range(i, T - 1)) - A[T - 1][i] for i in range(T - 1)]
    return sum(drops) / len(drops)


def backward_transfer(A: Matrix) -> float:
    T = _check(A)
    if T < 2:
        return 0.0
    return sum(A[T - 1][i] - A[i][i] for i in range(T - 1)) / (T - 1)


def sample_weighted_accuracy(correct: Sequence[int], total: Sequence[int]) -> float:
    n = sum(total)
    return 100.0 * sum(correct) / n if n else math.nan


def class_group_accuracy(
    class_correct: dict[int, int], class_total: dict[int, int], groups: dict[str, list[int]]
) -> dict[str, float]:
    """Static long-tailed evaluation (CAPT, FedLoGe): top-1 accuracy (%) over the whole (balanced) test set and
    over the test images of the head, mid and tail classes."""

    def acc(classes: Sequence[int]) -> float:
        n = sum(class_total.get(c, 0) for c in classes)
        return 100.0 * sum(class_correct.get(c, 0) for c in classes) / n if n else math.nan

    out = {"overall": acc(list(class_total))}
    out.update({name: acc(classes) for name, classes in groups.items()})
    return out


def summarize(A: Matrix, correct: Sequence[int], total: Sequence[int]) -> dict[str, float]:
    """The headline numbers of a class-incremental run."""
    return {
        "faa": final_average_accuracy(A),
        "sample_weighted_accuracy": sample_weighted_accuracy(correct, total),
        "average_forgetting": average_forgetting(A),
        "bwt": backward_transfer(A),
    }
