"""C2Prompt's class distribution compensation prompts (LCDC; `../shared/methods.md` §2.2–2.3).

One prompt of `length` input tokens per class of the client's current task (L_c = 3), appended after the patch
tokens without positional embedding and selected by the ground-truth label — so they exist only in training.
Trained at round 0 of a stage to minimise the diagonal-Gaussian NLL of the prompted feature f_{x,p} (final-norm
CLS with p^c_y appended, no discriminative prompt) under the server's global Gaussian N(μ^g_y, diag σ^g_y²):
    L_c = ½ Σ_d [(f_d − μ_d)² / (σ_d² + ε) + log(σ_d² + ε)]   (the log term is constant in the prompt),
then frozen. Initialisation N(0, 0.02²) (the sources are silent; ViT token convention).
"""

from __future__ import annotations

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec


class CompensationPrompts(nn.Module):
    """(classes, length, d) tokens; `spec(index)` appends each sample's class prompt after the patches."""

    def __init__(self, num_classes: int, length: int, dim: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.tokens = nn.Parameter(torch.randn(num_classes, length, dim, generator=generator) * 0.02)

    def spec(self, index: torch.Tensor) -> PromptSpec:
        return PromptSpec(tokens=self.tokens[index], token_position="append")


def gaussian_nll(f: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Per-sample diagonal-Gaussian negative log-likelihood (without the 2π constant)."""
    v = var + eps
    return 0.5 * ((f - mean).pow(2) / v + v.log()).sum(dim=-1)
