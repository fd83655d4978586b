"""CCVR: Classifier Calibration with Virtual Representations (Luo et al., NeurIPS 2021), for FCIL.

Paper §4: after federated training, each client uploads per-class feature mean and covariance (§4.1, Eq. 2);
the server pools them into one Gaussian per class with the exact global mean and covariance (Eq. 3–4, law
of total covariance), samples virtual features N(μ_c, Σ_c) for every class (§4.2) and retrains only the
classifier with CE on them.

Adaptation to class-incremental FL, as the HGP paper's baseline does (fed-mammoth `_models/ccvr.py`):
calibration runs after every round's FedAvg, over the Gaussians of every seen class; the Gaussians of a task
are frozen at its last round (no data of old tasks remains). Calibration optimiser from that code: SGD lr 0.01,
momentum 0.9, cosine, 5 epochs, 256 draws per class, batch 256.

Choices (switch → default):
- `components`: "pooled" (paper: one Gaussian per class) | "per_client" (fed-mammoth: a mixture over clients)
  → paper.
- `covariance`: "full" (paper) | "diag" → paper. Rank-deficient covariances (fewer samples than dimensions)
  are sampled through their eigendecomposition.
- `calibration.logit_norm_temperature`: None (paper: plain CE) | 0.1 (fed-mammoth) → paper.
- `class_weights`: "uniform" (paper: the same number of virtual features per class) | "counts" → paper.
- Backbone: `backbone_training: frozen` (default; the frozen-backbone setting of the prompt papers): `length: 0`
  trains the linear head only, `length > 0` puts CCVR on top of `fedavg_prompt`'s prefix prompt. `full`: the
  paper's (and fed-mammoth's, as HGP's table runs it) full fine-tuning of the ViT (`fedavg_ft`'s
  `FineTunedClassifier`; a hybrid backbone's CNN stem stays frozen), statistics of the fine-tuned features.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from torch import nn

from promptfcl.federation.protocol import MethodEnv
from promptfcl.methods.base import register_method
from promptfcl.methods.base.class_gaussians import ClassGaussianClient, ClassGaussianParams, ClassGaussianServer
from promptfcl.methods.base.finetune import FineTunedClassifier
from promptfcl.methods.base.prompt_models import build_prefix_model as prompt_model
from promptfcl.methods.base.signals import rebalancing_mechanism, rebalancing_on
from promptfcl.statistics.mixture import ClassWeights
from promptfcl.training.head_calibration import CalibrationParams


class CCVRParams(ClassGaussianParams):
    """CCVR defaults: pooled full-covariance Gaussians, equal draws per class, plain CE calibration."""

    length: int = Field(0, ge=0, description="0: frozen backbone + head; > 0: on top of fedavg_prompt's prefix")
    backbone_training: Literal["frozen", "full"] = Field(
        "frozen", description="full: fine-tune the whole ViT (the paper's setting; set a fine-tuning lr, e.g. 1e-5)"
    )

    @model_validator(mode="after")
    def _full_has_no_prompt(self) -> CCVRParams:
        if self.backbone_training == "full" and self.length:
            raise ValueError("backbone_training: full fine-tunes the ViT itself; set length: 0 (no prompt)")
        return self

    covariance: Literal["diag", "full"] = "full"
    components: Literal["per_client", "pooled"] = "pooled"
    class_weights: ClassWeights = "uniform"
    calibration: CalibrationParams = Field(default_factory=lambda: CalibrationParams(logit_norm_temperature=None))


def build_model(env: MethodEnv, p: CCVRParams) -> nn.Module:
    if p.backbone_training == "full":
        return FineTunedClassifier(env.backbone, env.label_space.num_logits)
    return prompt_model(env, p)


register_method(
    "ccvr",
    CCVRParams,
    ClassGaussianServer,
    ClassGaussianClient,
    build_model,
    "FedAvg + server classifier calibration on virtual features from pooled class Gaussians",
    "CCVR (Luo et al., NeurIPS 2021)",
    signals=(rebalancing_on, rebalancing_mechanism),
)
