"""Paired comparisons over seeds: per-seed differences, their mean, a Student-t confidence interval, sign counts.

A claim "A beats B" is tested on the seeds both cells ran: d_s = A_s − B_s, mean d̄, sample standard deviation s,
CI = d̄ ± t_{1−α/2, n−1} · s / √n. The t quantile is computed here (regularised incomplete beta by Lentz's continued
fraction, then bisection), so the core needs no SciPy.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t value with P(T ≤ t) = p (bisection on `t_cdf`, to 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError("p must lie in (0, 1)")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return 0.5 * (lo + hi)


@dataclass
class PairedDifference:
    """A − B over paired seeds: the differences, their mean, the CI and how many seeds favour A."""

    seeds: list[int]
    differences: list[float]
    mean: float
    low: float
    high: float
    positive: int
    confidence: float = 0.95

    @property
    def n(self) -> int:
        return len(self.differences)


def paired_difference(a: dict[int, float], b: dict[int, float], confidence: float = 0.95) -> PairedDifference:
    """The paired difference a − b over the seeds both have (a CI needs ≥ 2 of them)."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        raise ValueError(f"a paired comparison needs at least 2 common seeds, got {seeds}")
    d = [a[s] - b[s] for s in seeds]
    mean = statistics.fmean(d)
    half = t_quantile(0.5 + confidence / 2.0, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return PairedDifference(seeds, d, mean, mean - half, mean + half, sum(x > 0 for x in d), confidence)
