"""CLIP federated baselines of CAPT's tables (CAPT §4.1, App. B): PromptFL, MaPLe + FedAvg, FedCLIP, zero-shot.

All use a frozen open_clip CLIP (`backbone.kind: clip`) and classify by cosine similarity between the image
feature and class-text features (`promptfcl.clip_model.ClipClassifier`); clients train with CE over those
logits (the shared `SupervisedClient`) and the server takes the sample-weighted FedAvg of what is learnable.

- `promptfl` (Guo et al., TMC 2024): CoOp context vectors shared by all classes, FedAvg'd.
- `maple_fedavg` (Khattak et al., CVPR 2023 + FedAvg): deep language prompts in layers 0..J−1 and vision prompts
  produced from them by the coupling function (one Linear per depth), all FedAvg'd. MaPLe's J = 9.
- `cocoop_fedavg` (Zhou et al., CVPR 2022 + FedAvg): CoOp context shifted per image by a meta-net
  (Linear(e, e/16)–ReLU–Linear(e/16, w)) on the image feature, context and meta-net FedAvg'd. Each image needs
  its own C class texts, so a step costs B × C text-encoder passes (kept out of the CPU-scale study).
- `fedclip` (Lu et al., IEEE DEB 2023): an attention adapter softmax(W2·tanh(W1·z))⊙z on the frozen image feature,
  hidden size 128 (CAPT App. B), against the hand-crafted class texts "a photo of a {class}.", FedAvg'd.
- `clip_zeroshot`: no training; the hand-crafted class texts (the reference row of CAPT's Fig. 1 and 3).

Defaults from CAPT App. B: SGD, constant lr 1e-3, batch 32, 1 local epoch, prompt length 4, weights averaged
by sample counts. Inferred (not stated): momentum 0.9 and no weight decay (CoOp's SGD), no gradient
clipping, context initialised from the embeddings of "a photo of a" (CoOp / MaPLe), horizontal-flip
augmentation. Not implemented: FedTPG, FedOTP, FedPGP, KgCoOp, CLIP-LoRA.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from promptfcl.clip_model import ClipClassifier, ClipPromptParams
from promptfcl.evaluation.validity import prompt_mechanism
from promptfcl.federation.protocol import Grid, MethodEnv, RoundInfo
from promptfcl.methods.base import register_method
from promptfcl.methods.base.fedavg import FedAvgParams, FedAvgServer, SupervisedClient


class ClipFedAvgParams(FedAvgParams, ClipPromptParams):
    """Local training (CAPT App. B defaults) + the CLIP prompt shape."""

    optimizer: Literal["adam", "adamw", "sgd"] = "sgd"
    lr: float = Field(1e-3, gt=0)
    local_epochs: int = Field(1, gt=0)
    batch_size: int = Field(32, gt=0)
    grad_clip: float | None = Field(None, gt=0)


class MapleParams(ClipFedAvgParams):
    """MaPLe: deep prompts with the vision-language coupling."""

    depth: int = Field(9, ge=1)
    coupling: bool = True


class CoCoOpParams(ClipFedAvgParams):
    """CoCoOp: image-conditioned general context."""

    conditional: bool = True


class FedClipParams(ClipFedAvgParams):
    """FedCLIP: no text context, an attention adapter of hidden size 128."""

    n_ctx: int = Field(0, ge=0)
    adapter_hidden: int | None = Field(128, gt=0)


class ZeroShotParams(ClipFedAvgParams):
    """Zero-shot CLIP: nothing is learned."""

    n_ctx: int = Field(0, ge=0)


def build_clip_model(env: MethodEnv, p: ClipPromptParams) -> ClipClassifier:
    """The CLIP classifier over the run's classes (in logit order); needs `backbone.kind: clip`."""
    from promptfcl.backbones.clip_towers import ClipTowers

    if not isinstance(env.backbone, ClipTowers):
        raise ValueError(
            "CLIP methods need a CLIP backbone: set backbone.kind: clip and an open_clip backbone.name, or "
            "backbone.name: mini-clip (the CPU-scale stand-in)"
        )
    prompt = ClipPromptParams(**{k: getattr(p, k) for k in ClipPromptParams.model_fields})
    return ClipClassifier(env.backbone, env.class_names, prompt)


class ZeroShotServer(FedAvgServer):
    """No client is contacted: the global model is CLIP with hand-crafted class texts."""

    def run_round(self, grid: Grid, info: RoundInfo) -> dict[str, float]:
        return {"clients": 0}


register_method(
    "promptfl",
    ClipFedAvgParams,
    FedAvgServer,
    SupervisedClient,
    build_clip_model,
    "CLIP + CoOp context shared by all classes, FedAvg",
    "PromptFL (Guo et al., IEEE TMC 2024); CAPT baseline",
    signals=(prompt_mechanism,),
)
register_method(
    "maple_fedavg",
    MapleParams,
    FedAvgServer,
    SupervisedClient,
    build_clip_model,
    "CLIP + MaPLe deep text prompts coupled to vision prompts, FedAvg",
    "MaPLe (Khattak et al., CVPR 2023) + FedAvg; CAPT Table 2",
    signals=(prompt_mechanism,),
)
register_method(
    "cocoop_fedavg",
    CoCoOpParams,
    FedAvgServer,
    SupervisedClient,
    build_clip_model,
    "CLIP + CoCoOp image-conditioned context (meta-net), FedAvg",
    "CoCoOp (Zhou et al., CVPR 2022) + FedAvg; CAPT Table 2",
    signals=(prompt_mechanism,),
)
register_method(
    "fedclip",
    FedClipParams,
    FedAvgServer,
    SupervisedClient,
    build_clip_model,
    "CLIP + attention adapter (hidden 128) on the image feature, FedAvg",
    "FedCLIP (Lu et al., IEEE DEB 2023); CAPT Table 1",
    signals=(prompt_mechanism,),
)
register_method(
    "clip_zeroshot",
    ZeroShotParams,
    ZeroShotServer,
    SupervisedClient,
    build_clip_model,
    "zero-shot CLIP with 'a photo of a {class}.' (no training)",
    "CLIP (Radford et al., ICML 2021); CAPT Fig. 1 reference",
)
