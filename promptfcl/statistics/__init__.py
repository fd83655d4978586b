"""Class statistics clients upload instead of data, and the server-side Gaussian mixtures built from them."""

from promptfcl.statistics.class_stats import (
    ClassStatistics,
    RunningClassMeans,
    class_statistics,
    pooled,
    summarize,
    uploaded_statistics,
)
from promptfcl.statistics.mixture import GaussianComponents, MixtureSampler, alias_draw, alias_tables

__all__ = [
    "ClassStatistics",
    "GaussianComponents",
    "MixtureSampler",
    "RunningClassMeans",
    "alias_draw",
    "alias_tables",
    "class_statistics",
    "pooled",
    "summarize",
    "uploaded_statistics",
]
