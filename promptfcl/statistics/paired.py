"""Paired comparisons over seeds: per-seed differences, their mean, a Student-t confidence interval, sign counts.

A claim "A beats B" is tested on the seeds both cells ran: d_s = A_s − B_s, mean d̄, sample standard deviation s,
CI = d̄ ± t_{1−α/2, n−1} · s / √n, with SciPy's Student-t quantile.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import stats


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
    half = float(stats.t.ppf(0.5 + confidence / 2.0, len(d) - 1)) * statistics.stdev(d) / math.sqrt(len(d))
    return PairedDifference(seeds, d, mean, mean - half, mean + half, sum(x > 0 for x in d), confidence)
