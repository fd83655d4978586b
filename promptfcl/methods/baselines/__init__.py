"""Baselines that are registrations over the shared base: no code of their own beyond the base's builders.

- `fedavg_prompt` (FedAvg-Prompt, HGP's "prompt only" ablation: HGP §3 and Eq. 3 with the rebalancing step of
  §4 removed): one prefix prompt shared by all tasks, in each of layers 0–4 a (length, d) tensor, half key and
  half value prefix; a linear head on the final-norm CLS; clients CE over the current task's logits, Adam,
  gradient-norm clip 1.0; server FedAvg of prompt and head weighted by client sample counts. Defaults: length 20
  (HGP uses 200; `length` is configurable, 20 keeps CPU runs affordable), layers 0–4, Adam lr 3e-3 (HGP's
  CIFAR-100 lr), batch 16, 5 local epochs, zero prompt init (as HGP's official code effectively does).
- `fedvit` (FedViT): frozen ViT, only a linear head trained locally and FedAvg'd — the prompt-free lower bound of
  FedMGP's Table 1 and the classic "frozen backbone + linear probe" FL baseline. Adam lr 1e-3, 5 local epochs,
  batch 16. On personalized scenarios the head is averaged row by row over the clients whose current task holds
  each class (`personal_head: owners`, default); `personal_head: uniform` is FedMGP's official `fed_avg_head`.
- `fedavg_ft` (FedAvg-FT, the lower bound of HePCo's Table 1): full fine-tuning of the ViT (`base.finetune`)
  with a uniform average of the whole state; HePCo's fine-tuning defaults: Adam lr 5e-5, batch 64, 10 local
  epochs, CODA-P's per-epoch cosine.
- `fedl2p`, `feddualprompt`, `fedcodap`: L2P, DualPrompt and CODA-Prompt pools (`base.prompt_models`, each with
  its paper's shape) federated as HePCo's and HGP's baselines: FedAvg (uniform, as HePCo's code) of every
  trainable tensor, local training on HePCo's protocol (`PoolTrainingParams`). On personalized scenarios (FedMGP's
  Table 1 rows FedL2P / FedDualP) each head row is averaged over the clients whose current task holds its class
  (`personal_head: owners`); `personal_head: uniform` is FedMGP's official code, which divides a private class's
  row update by the number of clients every round (5× in the paper's setting), hence not the default. Prompts
  and keys are averaged over every client either way (the FedMGP paper's appendix describing its FedL2P /
  FedDualP adaptation is not available).
- `fedavg_prompt_pool` (HePCo's FedAvg-Prompt): HePCo's weighted pool and head, uniform average, no server
  distillation.
"""

from __future__ import annotations

from pydantic import Field

from promptfcl.evaluation.validity import prompt_mechanism
from promptfcl.methods.base import FedAvgParams, FedAvgServer, SupervisedClient, register_method
from promptfcl.methods.base.finetune import FullFineTuneParams, build_finetuned_model
from promptfcl.methods.base.prompt_models import (
    CodaParams,
    DualPromptParams,
    FedAvgPromptParams,
    L2PParams,
    WeightedPoolParams,
    build_codap,
    build_dualprompt,
    build_head_only_model,
    build_l2p,
    build_prefix_model,
    build_weighted_pool,
)


class FedViTParams(FedAvgParams):
    """FedViT hyper-parameters."""

    lr: float = Field(1e-3, gt=0)


register_method(
    "fedavg_prompt", FedAvgPromptParams, FedAvgServer, SupervisedClient, build_prefix_model,
    "one shared prefix prompt + linear head, sample-weighted FedAvg", "HGP (prompt-only ablation)",
    signals=(prompt_mechanism,),
)  # fmt: skip
register_method(
    "fedvit", FedViTParams, FedAvgServer, SupervisedClient, build_head_only_model,
    "frozen ViT + linear head, FedAvg", "FedMGP (KDD'24) baseline",
)  # fmt: skip
register_method(
    "fedavg_ft", FullFineTuneParams, FedAvgServer, SupervisedClient, build_finetuned_model,
    "full fine-tuning of the ViT + head, FedAvg (lower bound)", "HePCo (TMLR 2024) baseline",
)  # fmt: skip
register_method(
    "fedl2p", L2PParams, FedAvgServer, SupervisedClient, build_l2p,
    "L2P prompt pool with top-k key matching + head, FedAvg", "L2P (CVPR 2022)",
    signals=(prompt_mechanism,),
)  # fmt: skip
register_method(
    "feddualprompt", DualPromptParams, FedAvgServer, SupervisedClient, build_dualprompt,
    "DualPrompt G/E prompts + head, FedAvg", "DualPrompt (ECCV 2022)",
    signals=(prompt_mechanism,),
)  # fmt: skip
register_method(
    "fedcodap", CodaParams, FedAvgServer, SupervisedClient, build_codap,
    "CODA-Prompt components, keys, attention vectors + head, FedAvg", "CODA-Prompt (CVPR 2023)",
    signals=(prompt_mechanism,),
)  # fmt: skip
register_method(
    "fedavg_prompt_pool", WeightedPoolParams, FedAvgServer, SupervisedClient, build_weighted_pool,
    "HePCo's FedAvg-Prompt: weighted prompt pool + head, uniform average, no server distillation",
    "HePCo (TMLR 2024) baseline",
    signals=(prompt_mechanism,),
)  # fmt: skip
