"""Scenarios: class orders, task splits, client partitions, participation, label spaces."""

from promptfcl.scenario.build import build_scenario
from promptfcl.scenario.class_incremental import build_class_incremental
from promptfcl.scenario.label_space import LabelSpace, Task, masked_logits
from promptfcl.scenario.partition import PartitionError, dirichlet_partition, iid_partition
from promptfcl.scenario.scenario import Scenario

__all__ = [
    "LabelSpace",
    "PartitionError",
    "Scenario",
    "Task",
    "build_class_incremental",
    "build_scenario",
    "dirichlet_partition",
    "iid_partition",
    "masked_logits",
]
