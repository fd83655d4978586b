"""The Gaussian mechanism on uploaded statistics: clipping, calibrated noise, post-processing. One shared module.

Methods that upload statistics (HGP / CCVR class means and variances, FedProto prototypes, HePCo label
counts, and any later method: C2Prompt / CAPT call the same two functions) can release them with
(ε, δ)-differential privacy with respect to adding or removing one training sample of the uploading client.

Mechanism (per upload, `PrivacyParams`):
- every feature vector is clipped to L2 norm ≤ C (`clip`);
- per class of the task (a fixed, data-independent set: classes a client lacks are released too, as noise)
  the sufficient statistics n_c, S_c = Σ f and Q_c = Σ f⊙f (diag) or Σ f fᵀ (full) are computed. One sample
  changes one class's (n, S, Q) by at most (1, C, C²) in L2, so the normalised vector (n, S/C, Q/C²) has L2
  sensitivity Δ = √3 (√2 without Q);
- Gaussian noise N(0, σ²) is added to the normalised vector, σ from the analytic Gaussian mechanism (Balle &
  Wang, ICML 2018, Thm. 8) for (ε, δ) at sensitivity Δ·√k, where k = `releases` is the number of uploads of the
  same data the guarantee must cover (Gaussian releases compose exactly: k releases at noise σ are one release
  at sensitivity Δ√k);
- post-processing (free under DP): counts are rounded, classes with a noisy count below the method's minimum
  are dropped, means are S/n, variances (Q − n μ²)/(n − 1) clamped to ≥ 0 (covariances projected to PSD).
Label counts: one sample changes one count by 1, Δ = 1; noisy counts are rounded and clamped to ≥ 0.

What this does NOT cover (see docs/privacy.md): the model parameters uploaded beside the statistics, the
`num_samples` scalar, and anything the server learns from which clients answer. With `noise_seed: derived`
(the default, for reproducible simulations) the noise is a function of the run seed — a server that knows the
seed can remove it; deployments must use `noise_seed: os`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from promptfcl.seeding import torch_generator
from promptfcl.statistics.class_stats import ClassStatistics, Covariance


class PrivacyParams(BaseModel):
    """Optional Gaussian-mechanism noise on uploaded statistics (off unless `epsilon` is set)."""

    model_config = ConfigDict(extra="forbid")
    epsilon: float | None = Field(None, gt=0, description="ε of each client's upload; null: no noise")
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of the (ε, δ) guarantee")
    clip: float | None = Field(
        None, gt=0, description="L2 bound C on each feature vector (required with epsilon; noise on means ∝ C/n)"
    )
    releases: int = Field(
        1, ge=1, description="uploads of the same data (ε, δ) covers; rounds_per_task gives a per-task guarantee"
    )
    noise_seed: Literal["derived", "os"] = Field(
        "derived", description="derived: reproducible from the run seed (simulation only); os: secret OS randomness"
    )

    @model_validator(mode="after")
    def _clip_with_epsilon(self) -> PrivacyParams:
        if self.epsilon is not None and self.clip is None:
            raise ValueError(
                "set privacy.clip with privacy.epsilon: an L2 bound just above typical feature norms (LayerNorm "
                "features have norm ≈ √d, e.g. 14 for d = 192); features are scaled down to it"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.epsilon is not None


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_delta(sigma: float, epsilon: float, sensitivity: float = 1.0) -> float:
    """The exact δ(ε) of the Gaussian mechanism with noise σ at L2 sensitivity Δ (Balle & Wang 2018, Thm. 8)."""
    a, b = sensitivity / (2 * sigma), epsilon * sigma / sensitivity
    tail = _phi(-a - b)
    second = 0.0 if tail == 0.0 else math.exp(min(epsilon + math.log(tail), 700.0))  # e^ε·Φ(−a−b), no overflow
    return _phi(a - b) - second


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """The smallest σ for which the Gaussian mechanism at sensitivity Δ is (ε, δ)-DP (bisection, rel. tol 1e-9)."""
    if epsilon <= 0 or not 0 < delta < 1:
        raise ValueError("need epsilon > 0 and 0 < delta < 1")
    lo, hi = 1e-6 * sensitivity, sensitivity
    while gaussian_delta(hi, epsilon, sensitivity) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if gaussian_delta(mid, epsilon, sensitivity) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi


def noise_generator(p: PrivacyParams, seed: int, *keys: object) -> torch.Generator:
    """The generator of the noise: derived from the client step's seed, or fresh OS randomness."""
    if p.noise_seed == "os":
        g = torch.Generator()
        g.manual_seed(secrets.randbits(63))
        return g
    return torch_generator(seed, "privacy", *keys)


def clip_rows(feats: torch.Tensor, bound: float) -> torch.Tensor:
    """Scale every row to L2 norm ≤ `bound`."""
    norms = feats.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return feats * (bound / norms).clamp(max=1.0)


def unit_noise_sigma(p: PrivacyParams, parts: int) -> float:
    """σ on the normalised statistics vector with `parts` components of unit sensitivity each."""
    assert p.epsilon is not None
    return gaussian_sigma(p.epsilon, p.delta, math.sqrt(parts) * math.sqrt(p.releases))


def private_class_statistics(
    feats: torch.Tensor,
    targets: torch.Tensor,
    classes: Sequence[int],
    covariance: Covariance,
    min_count: int,
    p: PrivacyParams,
    gen: torch.Generator,
) -> ClassStatistics:
    """(ε, δ)-DP per-class count, mean and spread of `feats` for the fixed set `classes` (see module docs)."""
    C = float(p.clip or 0.0)
    f = clip_rows(feats.double(), C)
    d = f.shape[1]
    cls = torch.as_tensor(list(classes), dtype=torch.long)
    parts = 2 if covariance == "none" else 3
    sigma = unit_noise_sigma(p, parts)

    def noise(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * sigma

    counts, means, spreads = [], [], []
    for c in cls.tolist():
        fc = f[targets == c]
        n = float(len(fc)) + float(noise(1))
        s = fc.sum(0) + C * noise(d)
        q = None
        if covariance == "diag":
            q = fc.pow(2).sum(0) + C * C * noise(d)
        elif covariance == "full":
            q = fc.T @ fc + C * C * noise(d, d)
        counts.append(max(round(n), 0))
        n_hat = max(counts[-1], 1)
        mu = s / n_hat
        means.append(mu)
        if q is not None:
            spreads.append(_spread(q, mu, n_hat, covariance))
    keep = torch.tensor([k >= min_count for k in counts], dtype=torch.bool)
    idx = keep.nonzero().flatten().tolist()
    if not idx:
        shape = (0, d) if covariance != "full" else (0, d, d)
        return ClassStatistics(
            cls[:0],
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, d),
            None if covariance == "none" else torch.zeros(shape),
        )
    spread = torch.stack([spreads[i] for i in idx]).float() if spreads else None
    return ClassStatistics(
        cls[idx],
        torch.tensor([counts[i] for i in idx], dtype=torch.long),
        torch.stack([means[i] for i in idx]).float(),
        spread,
    )


def _spread(q: torch.Tensor, mu: torch.Tensor, n: int, covariance: Covariance) -> torch.Tensor:
    denom = max(n - 1, 1)
    if covariance == "diag":
        return ((q - n * mu * mu) / denom).clamp_min(0.0)
    m = (q - n * torch.outer(mu, mu)) / denom
    m = (m + m.T) / 2
    vals, vecs = torch.linalg.eigh(m)
    return (vecs * vals.clamp_min(0.0)) @ vecs.T


def private_counts(counts: torch.Tensor, p: PrivacyParams, gen: torch.Generator) -> torch.Tensor:
    """(ε, δ)-DP label counts: each count + N(0, σ²) at sensitivity 1, rounded, clamped to ≥ 0."""
    sigma = unit_noise_sigma(p, 1)
    noisy = counts.double() + torch.randn(counts.shape, generator=gen, dtype=torch.float64) * sigma
    return noisy.round().clamp_min(0).to(counts.dtype)
