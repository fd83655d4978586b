"""Scenarios: class orders, task splits, client partitions, participation, label spaces."""

from promptfcl.scenario.label_space import LabelSpace, Task, masked_logits
from promptfcl.scenario.partition import PartitionError, dirichlet_partition, iid_partition
from promptfcl.scenario.scenario import Scenario, build_class_incremental, build_scenario

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
