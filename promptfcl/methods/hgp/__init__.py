"""HGP: Federated Class-Incremental Learning with Hierarchical Generative Prototypes.

Salami et al. (`../shared/papers/004_…`), with the official code (aimagelab/fed-mammoth, `_models/hgp.py`)
for what the paper leaves out. Algorithm, per round:

1. Clients (§3.1, Eq. 2): load the global prefix prompt + head, train with CE over the current task's logits
   (Adam lr 3e-3 for CIFAR-100, batch 16, 5 local epochs, gradient-norm clip 1.0).
2. Clients (§3.2): for every class with ≥ 2 local samples, upload (n_{m,c}, μ_{m,c}, diag σ²_{m,c}) of the
   trained model's features (final-norm CLS with prompts) on the local training data, one pass, no grad.
3. Server (Eq. 3): FedAvg of prompt + head weighted by client sample counts.
4. Server (§3.2, Eq. 4–5): per current-task class a mixture over clients with π_{m,c} ∝ n_{m,c}; rebuilt
   every round; older tasks' mixtures are those of their last round.
5. Server (§3.3, Eq. 6): classifier rebalancing every round — draw on average 256 features per seen class,
   class → client component → N(μ, 3·σ² + 1e-8) with O(1) alias draws (the ×3 "to enhance dataset diversity",
   Appendix C.1), and retrain only the head for 5 epochs with CE on normalised logits (logits/‖logits‖ over seen
   classes, temperature 0.1), SGD lr 0.01, momentum 0.9, cosine schedule, batch 256.

Prompt (§3.1): one prefix shared by all tasks, in layers 0–4 a (200, d) tensor — 100 key + 100 value tokens.

Choices where paper and code differ (switch → default, and why):
- `class_weights`: "counts" (paper Eq. 6, ω_c ∝ Σ_m n_{m,c}) | "uniform" (code TODO: every seen class equally
  likely) → paper.
- `rebalance_optimizer`: "sgd_cosine" (paper; older code) | "local_lr" (later code: SGD at the local lr,
  no schedule; momentum and the rest of `calibration` unchanged) → paper.
- `augment`: "flip" | "crop_flip" (paper §4: "random cropping and horizontal flipping", here a reflection-padded
  translation; the paper configs `configs/hgp/*` set it) | "rrc_flip" (code: kornia `RandomResizedCrop(224,
  bicubic)`, scale (0.08, 1), ratio (3/4, 4/3), + flip; here cropped from the stored image straight to
  `backbone.img_size`) → "flip", the local-training default, which departs from the paper on purpose: an
  unaugmented or flipped image hits the hybrid backbone's stem cache, so the CPU presets stay affordable; set
  `crop_flip` for the paper, `rrc_flip` for the code.
- `stats_images`: "normalized" (paper, older code) | "raw" (later code's GPU-augmentation refactor computes
  statistics on unnormalised images) → paper.
- `prompt_init`: "zeros" (the code's CODA-style init with pool size 1 yields zeros) | "uniform" → code, the
  paper is silent.
- `optimizer_reset`: "round" (later code: new Adam every round) | "never" (older code, kept in client state)
  → later code, the paper is silent.
- `scale_full_covariance` (only with `covariance: full`, which Appendix B found no better): False
  (fed-mammoth's `full_cov` path samples N(μ, Σ + 1e-8·I), the ×3 only on diagonal variances) | True (the
  paper's "multiplying the covariance … by 3" read for any covariance) → code: that sentence describes the
  diagonal prototypes HGP uses (Appendix B); only the code says what full covariances get.
- `calibration.logit_norm_temperature` 0.1: code-only detail, kept as default.
Ablations (§5, Table 4) as config: `rebalance` = "all" (HGP) | "current" (CR_cur) | "old" (CR_old) |
"none" (= FedAvg-Prompt plus statistics); CR_cur / CR_old retrain only their classes' logits, as the
fed-mammoth ablation files slice them.
Deviation: the code ships the whole network each round; only the trainable prompt + head travel here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from promptfcl.methods.base import register_method
from promptfcl.methods.base.class_gaussians import ClassGaussianClient, ClassGaussianParams, ClassGaussianServer
from promptfcl.methods.base.prompt_models import build_prefix_model
from promptfcl.methods.base.signals import rebalancing_mechanism, rebalancing_on
from promptfcl.training.head_calibration import CalibrationParams


class HGPParams(ClassGaussianParams):
    """HGP defaults (paper §4 and Appendix H for CIFAR-100; code-only constants from fed-mammoth)."""

    length: int = Field(200, ge=0, description="prefix tokens per layer: half keys, half values")
    lr: float = Field(3e-3, gt=0, description="paper Appendix H: CIFAR-100 3e-3 (ImageNet-R 3e-2/3e-2/1e-2)")
    variance_scale: float = Field(3.0, gt=0, description="spread multiplier before sampling (paper Appendix C.1, code)")
    scale_full_covariance: bool = Field(
        False, description="also multiply full covariances by variance_scale (fed-mammoth inflates only diagonals)"
    )
    rebalance_optimizer: Literal["sgd_cosine", "local_lr"] = Field(
        "sgd_cosine",
        description="head rebalancing: calibration's SGD with a cosine schedule (paper), or SGD at the local lr with "
        "no schedule (later fed-mammoth code)",
    )


class HGPServer(ClassGaussianServer):
    """FedAvg + per-(client, class) Gaussian mixtures + head rebalancing every round."""

    def calibration_params(self) -> CalibrationParams:
        p = self.params
        if p.rebalance_optimizer == "local_lr":
            return p.calibration.model_copy(update={"lr": p.lr, "schedule": "constant"})
        return p.calibration

    def variance_scale(self) -> float:
        p = self.params
        if p.covariance == "full" and not p.scale_full_covariance:
            return 1.0  # fed-mammoth: cov = Σ + 1e-8·I for full covariances, (σ² + 1e-8)·3 for diagonal ones
        return p.variance_scale


register_method(
    "hgp",
    HGPParams,
    HGPServer,
    ClassGaussianClient,
    build_prefix_model,
    "shared prefix prompt + head; server rebalances the head on features sampled from client Gaussian mixtures",
    "HGP (Salami et al., 2025)",
    signals=(rebalancing_on, rebalancing_mechanism),
)
