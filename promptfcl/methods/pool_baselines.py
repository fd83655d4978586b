"""Federated prompt-pool baselines: FedAvg of prompts, keys, attention vectors and head.

- `fedl2p`: L2P (Wang et al., CVPR 2022) — pool 10, length 5, top-5 key matching, pull loss 0.1, input tokens.
- `feddualprompt`: DualPrompt (Wang et al., ECCV 2022) — G-prompt length 5 in layers 0–1, E-pool 10 of length
  5 in layers 2–4, task-keyed at training, nearest key at test.
- `fedcodap`: CODA-Prompt (Smith et al., CVPR 2023) — 100 components of length 8 in layers 0–4, split over the
  tasks, α = cos(q ⊙ A, K).
Federated as HePCo's and HGP's baselines: FedAvg (uniform, as HePCo's code) of every trainable tensor. Local
training follows HePCo's protocol (`PoolTrainingParams`: Adam lr 1e-3, batch 64, 10 epochs, CODA-P's per-epoch
cosine, CE over the current task's logits), so every pool method in a table shares one budget; each pool's own
shape defaults are its paper's.

Personalized scenarios (FedMGP's Table 1 rows FedL2P / FedDualP, `scenario.kind: personalized`): every client has
its own task sequence, so in a round a class's head row is trained only by the clients whose current task holds
it (in FedMGP's asynchronous setting a private class by one client). Default (`personal_head: owners`): each head
row is averaged over those clients only, and rows nobody trains keep their value — the owner-row averaging these
servers already do on asynchronous scenarios (`FedAvgServer.owned_head`). `personal_head: uniform` is FedMGP's
official code (`Server_DF.fed_avg_head`, a uniform mean of the whole head): a private class's row update is
divided by the number of clients every round (5× in the paper's setting), which is why it is not the default.
Prompts and keys are averaged over every client either way (the FedMGP paper's appendix describing its FedL2P /
FedDualP adaptation is not available).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from promptfcl.data.transforms import Augment
from promptfcl.federation.protocol import MethodEnv
from promptfcl.methods.fedavg import FedAvgParams, FedAvgServer, SupervisedClient
from promptfcl.methods.fedavg_prompt import check_layers
from promptfcl.methods.registry import register_method
from promptfcl.model import PromptedClassifier
from promptfcl.prompts import CodaPool, DualPromptPool, L2PPool
from promptfcl.prompts.pools import PromptPool


class PoolTrainingParams(FedAvgParams):
    """HePCo's local-training protocol, shared by every prompt-pool method."""

    weighting: Literal["samples", "uniform"] = "uniform"
    lr: float = Field(1e-3, gt=0)
    local_epochs: int = Field(10, gt=0)
    batch_size: int = Field(64, gt=0)
    lr_schedule: Literal["constant", "cosine", "coda_cosine"] = "coda_cosine"
    grad_clip: float | None = None
    augment: Augment = "crop_flip"
    query_cache: bool = Field(
        False,
        description="cache q(x) per exact input (use with augment: none or flip); a CPU speed-up: on a GPU, "
        "hashing each image on the host costs more than the query forward",
    )


def pooled_model(env: MethodEnv, p: PoolTrainingParams, pool: PromptPool) -> PromptedClassifier:
    check_layers(env, [x for attr in ("layers", "g_layers", "e_layers") for x in getattr(pool, attr, ())])
    env.backbone.enable_query_cache(p.query_cache)
    return PromptedClassifier(env.backbone, env.label_space.num_logits, pool)


class L2PParams(PoolTrainingParams):
    """L2P pool defaults (paper / official code)."""

    pool_size: int = Field(10, gt=0)
    length: int = Field(5, gt=0)
    top_k: int = Field(5, gt=0)
    mode: Literal["tokens", "prefix"] = "tokens"
    layers: list[int] = Field(default_factory=lambda: [0], description="prefix mode only")
    pull_coef: float = Field(0.1, ge=0)
    batchwise_voting: bool = False
    task_partition: int | None = Field(None, gt=0, description="prompts reserved per task at training time")


class DualPromptParams(PoolTrainingParams):
    """DualPrompt defaults (official code)."""

    g_layers: list[int] = Field(default_factory=lambda: [0, 1])
    g_length: int = Field(5, gt=0)
    e_layers: list[int] = Field(default_factory=lambda: [2, 3, 4])
    e_length: int = Field(5, gt=0)
    pool_size: int = Field(10, gt=0)
    pull_coef: float = Field(1.0, ge=0)


class CodaParams(PoolTrainingParams):
    """CODA-P defaults (paper: 100 components, length 8, layers 0–4, μ = 0)."""

    pool_size: int = Field(100, gt=0)
    length: int = Field(8, gt=0)
    layers: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4])
    ortho_mu: float = Field(0.0, ge=0)


def build_l2p(env: MethodEnv, p: L2PParams) -> PromptedClassifier:
    pool = L2PPool(
        env.backbone.embed_dim, p.pool_size, p.length, p.top_k, p.mode, p.layers, p.pull_coef,
        p.batchwise_voting, p.task_partition,
    )  # fmt: skip
    return pooled_model(env, p, pool)


def build_dualprompt(env: MethodEnv, p: DualPromptParams) -> PromptedClassifier:
    pool = DualPromptPool(
        env.backbone.embed_dim, p.g_layers, p.g_length, p.e_layers, p.e_length, p.pool_size, p.pull_coef
    )
    if env.label_space.num_tasks > p.pool_size:
        raise ValueError(f"DualPrompt needs one E-prompt per task: pool_size {p.pool_size} < tasks")
    return pooled_model(env, p, pool)


def build_codap(env: MethodEnv, p: CodaParams) -> PromptedClassifier:
    pool = CodaPool(env.backbone.embed_dim, env.num_stages, p.layers, p.pool_size, p.length, p.ortho_mu)
    return pooled_model(env, p, pool)


for _name, _params, _build, _summary, _paper in [
    ("fedl2p", L2PParams, build_l2p, "L2P prompt pool with top-k key matching + head, FedAvg", "L2P (CVPR 2022)"),
    ("feddualprompt", DualPromptParams, build_dualprompt, "DualPrompt G/E prompts + head, FedAvg",
     "DualPrompt (ECCV 2022)"),
    ("fedcodap", CodaParams, build_codap, "CODA-Prompt components, keys, attention vectors + head, FedAvg",
     "CODA-Prompt (CVPR 2023)"),
]:  # fmt: skip
    register_method(_name, _params, FedAvgServer, SupervisedClient, _build, _summary, _paper)
