"""Continual-learning metrics from an accuracy matrix.

`A[t][i]` is the accuracy (in %) on task i after training task t, defined for i ≤ t. Definitions:
- FAA (final average accuracy) = mean_i A[T-1][i] (HGP's FAA, HePCo's A_N);
- average accuracy after task t = mean_{i≤t} A[t][i] (the "accuracy after each task" curve);
- average forgetting = mean_{i<T-1} (max_{t<T-1} A[t][i] − A[T-1][i]) (Chaudhry et al., 2018);
- BWT = mean_{i<T-1} (A[T-1][i] − A[i][i]) (Lopez-Paz & Ranzato, 2017).

Knowledge retention (FedMGP, Yu et al. KDD'24 §3, Definitions 1–2), over clients i, in %:
- KR_t = 100 · mean_i Acc(θ_i^r; T_i^0) / Acc(θ_i^0; T_i^0) (temporal: the first task now vs when learned);
- KR_s = 100 · mean_i Acc(θ_g^r; T_i^r) / Acc(θ_i^r; T_i^r) (spatial: global vs local model, current task).
Clients whose denominator is 0 (or NaN) are left out of the mean.
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


def _mean_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    if len(num) != len(den):
        raise ValueError(f"{len(num)} numerators but {len(den)} denominators")
    ratios = [n / d for n, d in zip(num, den, strict=True) if d == d and d != 0 and n == n]
    return 100.0 * sum(ratios) / len(ratios) if ratios else math.nan


def temporal_retention(now: Sequence[float], initial: Sequence[float]) -> float:
    """KR_t in %: per client, accuracy on its first task now / when it was learned, averaged."""
    return _mean_ratio(now, initial)


def spatial_retention(global_acc: Sequence[float], local_acc: Sequence[float]) -> float:
    """KR_s in %: per client, the global model's / its local model's accuracy on its current task, averaged."""
    return _mean_ratio(global_acc, local_acc)


def summarize(A: Matrix, correct: Sequence[int], total: Sequence[int]) -> dict[str, float]:
    """The headline numbers of a class-incremental run."""
    return {
        "faa": final_average_accuracy(A),
        "sample_weighted_accuracy": sample_weighted_accuracy(correct, total),
        "average_forgetting": average_forgetting(A),
        "bwt": backward_transfer(A),
    }
