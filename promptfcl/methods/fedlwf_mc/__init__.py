"""FedLwF.MC: LwF.MC distillation from the previous-task model, with FedAvg (HePCo's Table 1 baseline).

LwF.MC (Rebuffi et al., CVPR 2017 — iCaRL's loss without exemplars): binary cross-entropy over all seen logits,
new classes against the one-hot label, old classes against the previous-task model's sigmoid outputs
(`training.regularizers.lwf_mc_loss`). Federated as in HePCo's code: clients are stateless, so the server sends
the previous-task global model with every round of a later task (counted in the bytes), and averages prompts
and head uniformly. The model is HePCo's weighted prompt pool + head (as its other prompt baselines).
"""

from __future__ import annotations

import torch
from torch import nn

from promptfcl.evaluation.validity import prompt_mechanism
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import ClientContext, RoundInfo
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import PreviousTaskServer, SupervisedClient
from promptfcl.methods.base.prompt_models import WeightedPoolParams, build_weighted_pool
from promptfcl.training.local import LossFn
from promptfcl.training.regularizers import lwf_mc_loss

PREV = PreviousTaskServer.PREV  # the previous-task model travels under the same prefix it is stored with


class LwFMCClient(SupervisedClient):
    """Trains with LwF.MC against the previous-task model the server sent (plain BCE on task 0)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._prev: nn.Module | None = None

    def loss_fn(self, message: Message, ctx: ClientContext) -> LossFn:
        space = self.env.label_space
        old = space.tasks[ctx.stage].logits[0]
        seen = space.seen_logits(ctx.stage)
        prev = None
        if any(k.startswith(PREV) for k in message.tensors):
            if self._prev is None:
                self._prev = self.new_model().eval()
            prev = self._prev
            prev.set_state({k[len(PREV) :]: v for k, v in message.tensors.items() if k.startswith(PREV)})

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            old_logits = None
            if prev is not None:
                with torch.no_grad():
                    old_logits = prev(x)
            return lwf_mc_loss(model(x), y, old_logits, old, seen)

        return loss


class LwFMCServer(PreviousTaskServer):
    """Uniform FedAvg; sends the previous-task model along during later tasks."""

    def downlink(self, info: RoundInfo) -> Message:
        msg = super().downlink(info)
        if self.prev is not None:
            msg.tensors.update({f"{PREV}{k}": v for k, v in self.prev.get_state().items()})
        return msg


register_method(
    "fedlwf_mc",
    WeightedPoolParams,
    LwFMCServer,
    LwFMCClient,
    build_weighted_pool,
    "weighted prompt pool + head trained with LwF.MC distillation from the previous-task model, FedAvg",
    "LwF.MC (CVPR 2017) as in HePCo's baselines",
    signals=(prompt_mechanism,),
)
