"""The floor every method stands on: FedAvg server and supervised client, class Gaussians, the shared prompted
models (prefix, pools, weighted pool), full fine-tuning, and `register_method`.

A method's folder imports from here (and from the folders of the methods its paper builds on, declared with
`register_method(builds_on=...)`), never from another method's folder.
"""

from promptfcl.methods.base.fedavg import (
    AggregationParams,
    FedAvgParams,
    FedAvgServer,
    PreviousTaskServer,
    RoundServer,
    SupervisedClient,
    loss_scalars,
    round_loss,
    set_task,
    usable_replies,
)
from promptfcl.methods.base.registration import register_method

__all__ = [
    "AggregationParams",
    "FedAvgParams",
    "FedAvgServer",
    "PreviousTaskServer",
    "RoundServer",
    "SupervisedClient",
    "loss_scalars",
    "register_method",
    "round_loss",
    "set_task",
    "usable_replies",
]
