"""Conditional latent generators for data-free server-side distillation (HePCo §4.2, Eq. 5–8).

A generator maps (class label, noise) to a pseudo-query z in the frozen backbone's query space. It is trained
adversarially against a set of "teacher" models: z must be classified as its label by the teachers (CE), while
maximising the disagreement (KL of logits, MSE of prompt outputs) between each teacher and the student; the
student is then distilled on such z. Models enter only through two callables per model — logits φ(z) over all
logits, and the prompt output ρ(z) — so any query-conditioned prompt method can use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Logits = Callable[[torch.Tensor], torch.Tensor]
PromptOut = Callable[[torch.Tensor], torch.Tensor]


class LatentGenerator(nn.Module):
    """Label embedding (64) ⊕ noise (64) → 128→256→1024→d with BatchNorm + ReLU (HePCo code `generator`)."""

    def __init__(self, num_labels: int, dim: int, embed: int = 64, noise: int = 64) -> None:
        super().__init__()
        self.noise_dim = noise
        self.embed = nn.Embedding(num_labels, embed)
        self.net = nn.Sequential(
            nn.Linear(embed + noise, 256),
            nn.BatchNorm1d(256),
            nn.ReLU(),
            nn.Linear(256, 1024),
            nn.BatchNorm1d(1024),
            nn.ReLU(),
            nn.Linear(1024, dim),
        )

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        eps = torch.randn(len(labels), self.noise_dim, device=labels.device)  # global RNG, seeded per round
        return self.net(torch.cat([self.embed(labels), eps], dim=1))


@dataclass
class Teacher:
    """A model the generator is trained against: its logits, its prompt output and per-label weights."""

    logits: Logits
    prompts: PromptOut
    weight: torch.Tensor  # (num_labels,) weight of each label's samples for this teacher


def sample_labels(histogram: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """`n` labels drawn ∝ `histogram` (counts over all logits)."""
    return torch.multinomial(histogram.double().cpu(), n, replacement=True, generator=gen)


def train_generator(
    generator: LatentGenerator,
    teachers: Sequence[Teacher],
    student_logits: Logits,
    student_prompts: PromptOut,
    histogram: torch.Tensor,
    allowed: torch.Tensor,
    iterations: int,
    batch_size: int,
    lr: float,
    lambda_kl: float,
    lambda_mse: float,
    gen: torch.Generator,
) -> list[float]:
    """Minimise Σ_t w_t·CE(φ_t(z), y) − λ_KL Σ_t w_t·KL(φ_t(z) ‖ φ_s(z)) − λ_MSE Σ_t w_t·‖ρ_s(z) − ρ_t(z)‖².

    Sums over the batch (HePCo code); logits restricted to `allowed` (the seen classes). Only the generator is
    updated. Returns the loss of every iteration.
    """
    opt = torch.optim.Adam(generator.parameters(), lr=lr)
    generator.train()
    losses = []
    device = allowed.device
    cols = torch.nonzero(allowed).flatten()  # logits outside `allowed` are dropped, not set to -inf: the KL
    remap = torch.full((len(allowed),), -1, dtype=torch.long, device=device)  # gradient would be NaN there
    remap[cols] = torch.arange(len(cols), device=device)
    for _ in range(iterations):
        y = sample_labels(histogram, batch_size, gen).to(device)
        z = generator(y)
        s_logp = F.log_softmax(student_logits(z)[:, cols], dim=1)
        s_prompt = student_prompts(z)
        loss = z.new_zeros(())
        for t in teachers:
            w = t.weight.to(device)[y]
            t_logits = t.logits(z)[:, cols]
            ce = F.cross_entropy(t_logits, remap[y], reduction="none")
            t_logp = F.log_softmax(t_logits, dim=1)
            kl = (t_logp.exp() * (t_logp - s_logp)).sum(1)
            mse = (s_prompt - t.prompts(z)).pow(2).flatten(1).sum(1)
            loss = loss + (w * (ce - lambda_kl * kl - lambda_mse * mse)).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    generator.eval()
    return losses
