"""FedViT: frozen ViT, only a linear head trained locally and FedAvg'd.

The prompt-free lower bound used by FedMGP (Yu et al., KDD'24, Table 1) and the classic "frozen backbone +
linear probe" FL baseline. Defaults: Adam lr 1e-3, 5 local epochs, batch 16, CE over the current task's logits.
On personalized scenarios (FedMGP's Table 1) the head is averaged row by row over the clients whose current task
holds each class (`personal_head: owners`, default; see `FedAvgServer.owned_head`); `personal_head: uniform`
averages the whole head over every client, as FedMGP's official `fed_avg_head`, which shrinks the update of a
class that one client trains (a private class) by the number of clients every round.
"""

from __future__ import annotations

from pydantic import Field

from promptfcl.federation.protocol import MethodEnv
from promptfcl.methods.fedavg import FedAvgParams, FedAvgServer, SupervisedClient
from promptfcl.methods.registry import register_method
from promptfcl.model import PromptedClassifier


class FedViTParams(FedAvgParams):
    """FedViT hyper-parameters."""

    lr: float = Field(1e-3, gt=0)


def build_model(env: MethodEnv, p: FedViTParams) -> PromptedClassifier:
    return PromptedClassifier(env.backbone, env.label_space.num_logits, prompt=None)


register_method(
    "fedvit",
    FedViTParams,
    FedAvgServer,
    SupervisedClient,
    build_model,
    "frozen ViT + linear head, FedAvg",
    "FedMGP (KDD'24) baseline",
)
