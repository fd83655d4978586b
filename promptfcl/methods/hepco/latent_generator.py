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
from functools import partial

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


def backward_sum(
    outputs: Sequence[torch.Tensor],
    terms: Sequence[Callable[..., torch.Tensor]],
    inputs: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Backpropagate Σ_k terms[k](*outputs) one term at a time; return the sum's value (detached).

    Each term is evaluated on detached copies of `outputs` and backpropagated at once, so only one term's graph
    is alive at a time (HePCo's generator loss holds one client teacher's graph, not all of them); the gradients
    it leaves on those copies are summed, then pushed through the shared graph behind `outputs` once. By
    linearity this is the gradient of the summed loss (equal up to float summation order). Gradients accumulate
    into `inputs` only when given (else into every leaf of the graph, as `Tensor.backward`).
    """
    leaves = [o.detach().requires_grad_(o.requires_grad) for o in outputs]
    total: torch.Tensor | None = None
    for term in terms:
        loss = term(*leaves)
        if loss.requires_grad:
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    pairs = [(o, leaf.grad) for o, leaf in zip(outputs, leaves, strict=True) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=inputs)
    return total if total is not None else torch.zeros(())


def disagreement(
    t: Teacher,
    y: torch.Tensor,
    cols: torch.Tensor,
    remap: torch.Tensor,
    lambda_kl: float,
    lambda_mse: float,
    z: torch.Tensor,
    s_logp: torch.Tensor,
    s_prompt: torch.Tensor,
    kl_direction: str = "client_server",
) -> torch.Tensor:
    """One teacher's term of the generator loss, Σ_batch w_t(y)·(CE(φ_t(z), y) − λ_KL·KL(φ_t ‖ φ_s) −
    λ_MSE·‖ρ_s − ρ_t‖²), with logits restricted to the columns `cols` (labels remapped by `remap`);
    `kl_direction: server_client` takes KL(φ_s ‖ φ_t) instead (the paper's Eq. 4a)."""
    w = t.weight.to(z.device)[y]
    t_logits = t.logits(z)[:, cols]
    ce = F.cross_entropy(t_logits, remap[y], reduction="none")
    t_logp = F.log_softmax(t_logits, dim=1)
    p, q = (t_logp, s_logp) if kl_direction == "client_server" else (s_logp, t_logp)
    kl = (p.exp() * (p - q)).sum(1)
    mse = (s_prompt - t.prompts(z)).pow(2).flatten(1).sum(1)
    return (w * (ce - lambda_kl * kl - lambda_mse * mse)).sum()


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
    kl_direction: str = "client_server",
) -> list[float]:
    """Minimise Σ_t w_t·CE(φ_t(z), y) − λ_KL Σ_t w_t·KL(φ_t(z) ‖ φ_s(z)) − λ_MSE Σ_t w_t·‖ρ_s(z) − ρ_t(z)‖².

    Sums over the batch (HePCo code); logits restricted to `allowed` (the seen classes). Only the generator is
    updated. The sum over teachers is backpropagated one teacher at a time (`backward_sum`), so memory does not
    grow with their number. Returns the loss of every iteration.
    """
    opt = torch.optim.Adam(generator.parameters(), lr=lr)
    generator.train()
    losses = []
    device = allowed.device
    cols = torch.nonzero(allowed).flatten()  # logits outside `allowed` are dropped, not set to -inf: the KL
    remap = torch.full((len(allowed),), -1, dtype=torch.long, device=device)  # gradient would be NaN there
    remap[cols] = torch.arange(len(cols), device=device)
    params = list(generator.parameters())
    for _ in range(iterations):
        y = sample_labels(histogram, batch_size, gen).to(device)
        z = generator(y)
        s_logp = F.log_softmax(student_logits(z)[:, cols], dim=1)
        s_prompt = student_prompts(z)
        opt.zero_grad(set_to_none=True)
        terms = [
            partial(disagreement, t, y, cols, remap, lambda_kl, lambda_mse, kl_direction=kl_direction) for t in teachers
        ]
        loss = backward_sum([z, s_logp, s_prompt], terms, params)
        opt.step()
        losses.append(float(loss))
    generator.eval()
    return losses
