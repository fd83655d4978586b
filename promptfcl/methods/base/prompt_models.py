"""Prompted models the methods share: the prefix prompt, the query-conditioned pools and HePCo's weighted pool.

Each builder turns a method's params into a `PromptedClassifier` (frozen backbone by reference + prompt module +
linear head on the final-norm CLS). The params classes hold each prompt's paper-default shape:

- `FedAvgPromptParams` / `build_prefix_model`: one prefix shared by all tasks, in each of layers 0–4 a
  (length, d) tensor, first half key prefix, second half value prefix (HGP §3.1; `PromptSpec.split_half`).
- `PoolTrainingParams`: HePCo's local-training protocol (Adam lr 1e-3, batch 64, 10 epochs, CODA-P's per-epoch
  cosine, uniform FedAvg), shared by every prompt-pool method so a table of pool methods has one budget.
- `L2PParams` (L2P, Wang et al., CVPR 2022: pool 10, length 5, top-5 key matching, pull loss 0.1, input tokens),
  `DualPromptParams` (DualPrompt, ECCV 2022: G-prompt length 5 in layers 0–1, E-pool 10 of length 5 in layers
  2–4), `CodaParams` (CODA-Prompt, CVPR 2023: 100 components of length 8 in layers 0–4, split over the tasks).
- `WeightedPoolParams` / `build_weighted_pool`: HePCo's decomposed prompt (a cosine-weighted sum of pool
  components) on the shared pool-training protocol.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from promptfcl.data.transforms import Augment
from promptfcl.federation.protocol import MethodEnv
from promptfcl.methods.base.fedavg import FedAvgParams
from promptfcl.model import PromptedClassifier
from promptfcl.prompts import CodaPool, DualPromptPool, L2PPool
from promptfcl.prompts.pools import PromptPool
from promptfcl.prompts.prefix import PrefixPrompt
from promptfcl.prompts.weighted_pool import WeightedPool


def check_layers(env: MethodEnv, layers: list[int]) -> None:
    """Prompt layers must exist in the backbone (a clear error instead of an index error mid-run)."""
    if any(not 0 <= layer < env.backbone.num_layers for layer in layers):
        raise ValueError(f"prompt layers {sorted(layers)} outside the backbone's 0..{env.backbone.num_layers - 1}")


class FedAvgPromptParams(FedAvgParams):
    """Prefix-prompt shape on top of local-training and FedAvg settings."""

    length: int = Field(
        20, ge=0, description="prefix tokens per layer, split half keys / half values; 0: no prompt (head only)"
    )
    layers: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4])
    prompt_init: Literal["zeros", "uniform"] = "zeros"


def build_prefix_model(env: MethodEnv, p: FedAvgPromptParams) -> PromptedClassifier:
    """One shared prefix prompt (none when `length` is 0) and a linear head."""
    check_layers(env, p.layers)
    prompt = PrefixPrompt(env.backbone.embed_dim, p.layers, p.length, p.prompt_init) if p.length else None
    return PromptedClassifier(env.backbone, env.label_space.num_logits, prompt)


def build_head_only_model(env: MethodEnv, p: FedAvgParams) -> PromptedClassifier:
    """The frozen backbone and a linear head, no prompt."""
    return PromptedClassifier(env.backbone, env.label_space.num_logits, prompt=None)


class PoolTrainingParams(FedAvgParams):
    """HePCo's local-training protocol, shared by every prompt-pool method."""

    weighting: Literal["samples", "uniform"] = "uniform"
    lr: float = Field(1e-3, gt=0)
    local_epochs: int = Field(10, gt=0)
    batch_size: int = Field(64, gt=0)
    lr_schedule: Literal["constant", "cosine", "coda_cosine"] = "coda_cosine"
    grad_clip: float | None = None
    augment: Augment = Field(
        "crop_flip",
        description="training augmentation: none | flip | crop_flip (flip + a reflection-padded translation) | "
        "rrc_flip (RandomResizedCrop + flip, as the official fed-mammoth / HePCo codes)",
    )
    query_cache: bool = Field(
        False,
        description="cache q(x) per exact input (use with augment: none or flip); a CPU speed-up: on a GPU, "
        "hashing each image on the host costs more than the query forward",
    )


def pooled_model(env: MethodEnv, p: PoolTrainingParams, pool: PromptPool) -> PromptedClassifier:
    """A `PromptedClassifier` around a query-conditioned pool (its layers checked, the query cache as configured)."""
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


class WeightedPoolParams(PoolTrainingParams):
    """HePCo's decomposed prompt on the shared pool-training protocol (the FedAvg-Prompt baseline's settings)."""

    pool_size: int = Field(100, gt=0)
    length: int = Field(20, gt=0, description="prompt tokens per component: half keys, half values")
    layers: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4])
    detach_query: bool = Field(
        False, description="code: the pool detaches its query, so the generator's prompt-MSE term has no gradient"
    )


def build_weighted_pool(env: MethodEnv, p: WeightedPoolParams) -> PromptedClassifier:
    pool = WeightedPool(env.backbone.embed_dim, p.layers, p.pool_size, p.length, detach_query=p.detach_query)
    return pooled_model(env, p, pool)
