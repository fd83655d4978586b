"""Metric formulas against hand-computed values."""

from __future__ import annotations

import math

import pytest

from promptfcl.evaluation.metrics import (
    accuracy_curve,
    average_forgetting,
    backward_transfer,
    final_average_accuracy,
    sample_weighted_accuracy,
    summarize,
)

# A[t][i]: accuracy on task i after training task t
A = [
    [90.0],
    [70.0, 80.0],
    [60.0, 75.0, 85.0],
]


def test_final_average_accuracy() -> None:
    assert final_average_accuracy(A) == pytest.approx((60 + 75 + 85) / 3)


def test_accuracy_curve() -> None:
    assert accuracy_curve(A) == pytest.approx([90.0, 75.0, 220 / 3])


def test_average_forgetting_uses_best_earlier_accuracy() -> None:
    # task 0: best 90 (after task 0) → 60: drop 30; task 1: best 80 → 75: drop 5
    assert average_forgetting(A) == pytest.approx((30 + 5) / 2)
    # a task that improves later and then drops: best is the max over earlier rows, not the diagonal
    B = [[50.0], [70.0, 80.0], [65.0, 80.0, 90.0]]
    assert average_forgetting(B) == pytest.approx((5 + 0) / 2)


def test_backward_transfer() -> None:
    assert backward_transfer(A) == pytest.approx(((60 - 90) + (75 - 80)) / 2)


def test_single_task_and_sample_weighting() -> None:
    assert average_forgetting([[50.0]]) == 0.0 and backward_transfer([[50.0]]) == 0.0
    assert sample_weighted_accuracy([9, 1], [10, 90]) == pytest.approx(10.0)
    assert math.isnan(sample_weighted_accuracy([], []))
    s = summarize(A, [60, 150], [100, 200])
    assert s["sample_weighted_accuracy"] == pytest.approx(70.0)


def test_malformed_matrix_is_refused() -> None:
    with pytest.raises(ValueError, match="row 1"):
        final_average_accuracy([[1.0], [2.0]])
