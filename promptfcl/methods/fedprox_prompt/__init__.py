"""FedProx on prompts: HePCo's FedAvg-Prompt with the proximal term (HePCo code `--loss_type fedprox`).

FedProx (Li et al., MLSys 2020, Eq. 2): each client minimises its loss + (μ/2)‖w − w_server‖² over the trainable
tensors (weighted-pool prompts, keys and head), μ = 0.01 as in HePCo's code. Everything else is
`fedavg_prompt_pool` (uniform average, no server distillation).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from promptfcl.evaluation.validity import prompt_mechanism, switch_on
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import ClientContext
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import FedAvgServer, SupervisedClient
from promptfcl.methods.base.prompt_models import WeightedPoolParams, build_weighted_pool
from promptfcl.training.local import LossFn, LossTerms, cross_entropy_terms
from promptfcl.training.regularizers import proximal_term


class FedProxParams(WeightedPoolParams):
    """Weighted-pool prompt settings plus the proximal weight."""

    mu: float = Field(0.01, ge=0, description="proximal weight μ (the term is μ/2·‖w − w_server‖²)")


class FedProxClient(SupervisedClient):
    """CE over the current task + the proximal term to the round's server weights."""

    def loss_fn(self, message: Message, ctx: ClientContext) -> LossFn:
        server = {k: v.to(ctx.device) for k, v in message.tensors.items()}
        mu = self.params.mu

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> LossTerms:
            terms = cross_entropy_terms(model, x, y, mask)
            return LossTerms(terms.total + proximal_term(model, server, mu), terms.ce)

        return loss


proximal_on = switch_on("proximal_on", "mu", "the FedProx proximal term")


register_method(
    "fedprox_prompt",
    FedProxParams,
    FedAvgServer,
    FedProxClient,
    build_weighted_pool,
    "weighted prompt pool + head with the FedProx proximal term, uniform average",
    "FedProx (MLSys 2020) as in HePCo's code",
    signals=(proximal_on, prompt_mechanism),
)
