"""Evaluation regimes and continual-learning metrics."""

from promptfcl.evaluation.evaluator import Evaluator, TaskResult
from promptfcl.evaluation.metrics import (
    accuracy_curve,
    average_forgetting,
    backward_transfer,
    class_group_accuracy,
    final_average_accuracy,
    sample_weighted_accuracy,
    spatial_retention,
    summarize,
    temporal_retention,
)

__all__ = [
    "Evaluator",
    "TaskResult",
    "accuracy_curve",
    "average_forgetting",
    "backward_transfer",
    "class_group_accuracy",
    "final_average_accuracy",
    "sample_weighted_accuracy",
    "spatial_retention",
    "summarize",
    "temporal_retention",
]
