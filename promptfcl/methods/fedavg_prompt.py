"""FedAvg-Prompt: HGP's prompting without its server step.

HGP paper (Salami et al., "Federated Class-Incremental Learning with Hierarchical Generative Prototypes"),
§3 "prompt-based backbone" and Eq. 3 (weighted FedAvg), with the rebalancing step of §4 removed — the
paper's "prompt only" ablation row. One prefix prompt shared by all tasks: in each of layers 0–4 a
(length, d) tensor, first half key prefix, second half value prefix (`PromptSpec.split_half`); a linear
head on the final-norm CLS. Clients: CE over the current task's logits, Adam, gradient-norm clip 1.0.
Server: FedAvg of prompt and head weighted by client sample counts.

Defaults follow the core issue: length 20 (10 key + 10 value tokens), layers 0–4, Adam lr 3e-3 (HGP's
CIFAR-100 lr), batch 16, 5 local epochs, zero prompt init (as HGP's official code effectively does).
Deviation: HGP uses length 200 (100 + 100); `length` is configurable, 20 keeps CPU runs affordable.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from promptfcl.federation.protocol import MethodEnv
from promptfcl.methods.fedavg import FedAvgParams, FedAvgServer, SupervisedClient
from promptfcl.methods.registry import register_method
from promptfcl.model import PromptedClassifier
from promptfcl.prompts.prefix import PrefixPrompt


class FedAvgPromptParams(FedAvgParams):
    """Prefix-prompt shape on top of local-training and FedAvg settings."""

    length: int = Field(
        20, ge=0, description="prefix tokens per layer, split half keys / half values; 0: no prompt (head only)"
    )
    layers: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4])
    prompt_init: Literal["zeros", "uniform"] = "zeros"


def check_layers(env: MethodEnv, layers: list[int]) -> None:
    """Prompt layers must exist in the backbone (a clear error instead of an index error mid-run)."""
    if any(not 0 <= layer < env.backbone.num_layers for layer in layers):
        raise ValueError(f"prompt layers {sorted(layers)} outside the backbone's 0..{env.backbone.num_layers - 1}")


def build_model(env: MethodEnv, p: FedAvgPromptParams) -> PromptedClassifier:
    check_layers(env, p.layers)
    prompt = PrefixPrompt(env.backbone.embed_dim, p.layers, p.length, p.prompt_init) if p.length else None
    return PromptedClassifier(env.backbone, env.label_space.num_logits, prompt)


register_method(
    "fedavg_prompt",
    FedAvgPromptParams,
    FedAvgServer,
    SupervisedClient,
    build_model,
    "one shared prefix prompt + linear head, sample-weighted FedAvg",
    "HGP (prompt-only ablation)",
)
