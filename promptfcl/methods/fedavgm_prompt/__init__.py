"""FedAvgM on the shared prefix prompt: FedAvg with server momentum (Hsu, Qi and Brown, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", arXiv 1909.06335, 2019, §3 / Algorithm 1).

Clients are FedAvg-Prompt's (one prefix prompt shared by all tasks + a linear head, CE over the current task's
logits). The server treats the round's averaged change as a pseudo-gradient and applies it with momentum:

    Δ_t = w_{t-1} − FedAvg(w_k),   v_t = β·v_{t-1} + Δ_t,   w_t = w_{t-1} − η·v_t

with server momentum β (`server_momentum`, the paper's best CIFAR-10 values are 0.7–0.9; default 0.9) and server
learning rate η (`server_lr`, 1.0 as in the paper's Algorithm 1). β = 0 and η = 1 give FedAvg exactly. The velocity
is part of the server state (checkpointed) and carries across tasks, as the paper's single sequence of rounds does.

This method is also the worked example of ARCHITECTURE.md's "Adding a method": params with the paper's defaults,
one server hook (`aggregate`), a validity signal of its own (`momentum`), and its registration.

Deviation: the paper runs FedAvgM on full models; here it runs on FedAvg-Prompt's trainable tensors (prompt + head),
the only ones that travel.
"""

from __future__ import annotations

import torch
from pydantic import Field

from promptfcl.evaluation.validity import Check, RunEvidence, series
from promptfcl.federation.message import Message, Record
from promptfcl.methods.base import FedAvgServer, SupervisedClient, register_method
from promptfcl.methods.base.prompt_models import FedAvgPromptParams, build_prefix_model

VELOCITY = "velocity/"


class FedAvgMParams(FedAvgPromptParams):
    """FedAvg-Prompt's client settings plus the server optimiser (paper Algorithm 1)."""

    server_momentum: float = Field(0.9, ge=0, lt=1, description="β: server momentum (paper: 0.7–0.9 best on CIFAR-10)")
    server_lr: float = Field(1.0, gt=0, description="η: server learning rate (paper Algorithm 1: 1)")


class FedAvgMServer(FedAvgServer):
    """FedAvg whose averaged change is applied as a momentum step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.velocity: dict[str, torch.Tensor] = {}

    def aggregate(self, replies: dict[int, Message]) -> dict[str, float]:
        p = self.params
        previous = self.model.get_state()
        super().aggregate(replies)  # the FedAvg mean, now in the model
        mean = self.model.get_state()
        stepped = {}
        for k, w in previous.items():
            if not w.is_floating_point():
                stepped[k] = mean[k]
                continue
            v = p.server_momentum * self.velocity.get(k, torch.zeros_like(w)) + (w - mean[k])
            self.velocity[k] = v
            stepped[k] = w - p.server_lr * v
        self.model.set_state(stepped)
        norm = sum(float(v.double().pow(2).sum()) for v in self.velocity.values()) ** 0.5
        return {"server_velocity_norm": norm}

    def state(self) -> Record:
        record = super().state()
        record.tensors.update({VELOCITY + k: v for k, v in self.velocity.items()})
        return record

    def load_state(self, state: Record) -> None:
        own = {k: v for k, v in state.tensors.items() if not k.startswith(VELOCITY)}
        super().load_state(Record(own, state.scalars))
        self.velocity = {k[len(VELOCITY) :]: v for k, v in state.tensors.items() if k.startswith(VELOCITY)}


def check_momentum(run: RunEvidence) -> Check | None:
    """The server step used its momentum: the velocity's norm is positive in the rounds after the first
    (with β = 0 it equals the plain FedAvg change, so β must also be positive)."""
    norms = series(run.rounds, "server_velocity_norm")
    if len(norms) < 2:
        return None
    beta = float(run.config.get("method", {}).get("server_momentum", 0.0))
    ok = beta > 0 and min(norms[1:]) > 0
    detail = f"velocity norm {min(norms[1:]):.4g} at its smallest after round 0"
    return Check("momentum", beta, "> 0 (server momentum β) with a moving velocity", ok, detail)


register_method(
    "fedavgm_prompt",
    FedAvgMParams,
    FedAvgMServer,
    SupervisedClient,
    build_prefix_model,
    "FedAvg-Prompt with server momentum (FedAvgM): the averaged change applied as a momentum step",
    "FedAvgM (Hsu et al., 2019)",
    signals=(check_momentum,),
)
