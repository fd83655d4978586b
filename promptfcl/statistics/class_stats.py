"""Per-class feature statistics computed on a client and uploaded in place of data.

Shared by every method that summarises local features per class: HGP (count, mean, diagonal variance per
class, §3.2 of the HGP paper), CCVR (mean and full covariance, Luo et al. NeurIPS'21 §4) and FedProto (class
means as prototypes, Tan et al. AAAI'22 Eq. 5). Statistics are computed with the client's just-trained model on
its local training data under a fixed (eval) transform, one pass, no gradient. Only (count, mean, variance or
covariance) per class ever leaves the client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import ImageTransform
from promptfcl.federation.message import Record
from promptfcl.federation.validation import TensorSpec

Covariance = Literal["none", "diag", "full"]
PREFIX = "stats/"


@dataclass
class ClassStatistics:
    """Feature statistics of some classes: `classes` (C,) logit ids, `counts` (C,), `means` (C,d),
    `spread` (C,d) unbiased diagonal variances, (C,d,d) unbiased covariances, or None."""

    classes: torch.Tensor
    counts: torch.Tensor
    means: torch.Tensor
    spread: torch.Tensor | None = None

    @property
    def covariance(self) -> Covariance:
        if self.spread is None:
            return "none"
        return "full" if self.spread.dim() == 3 else "diag"

    def __len__(self) -> int:
        return int(self.classes.numel())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Message tensors under the `stats/` prefix (counted in the byte totals like any payload)."""
        out = {f"{PREFIX}classes": self.classes, f"{PREFIX}counts": self.counts, f"{PREFIX}means": self.means}
        if self.spread is not None:
            out[f"{PREFIX}spread"] = self.spread
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> ClassStatistics:
        return cls(
            tensors[f"{PREFIX}classes"].long(),
            tensors[f"{PREFIX}counts"].long(),
            tensors[f"{PREFIX}means"],
            tensors.get(f"{PREFIX}spread"),
        )


def statistics_schema(num_logits: int, dim: int, covariance: Covariance) -> dict[str, TensorSpec]:
    """What an upload of `ClassStatistics` must look like: C class ids in range, C positive counts, (C, d) means
    and (C, d) / (C, d, d) spreads — checked by the `Grid` before a server pools anything."""
    out = {
        f"{PREFIX}classes": TensorSpec(("C",), torch.long, 0, num_logits - 1),
        f"{PREFIX}counts": TensorSpec(("C",), torch.long, 1),
        f"{PREFIX}means": TensorSpec(("C", dim), torch.float32),
    }
    if covariance == "diag":
        out[f"{PREFIX}spread"] = TensorSpec(("C", dim), torch.float32, 0)
    elif covariance == "full":
        out[f"{PREFIX}spread"] = TensorSpec(("C", dim, dim), torch.float32)
    return out


def uploaded_statistics(replies: Mapping[int, Record]) -> list[ClassStatistics]:
    """The non-empty statistics carried by client replies (replies without any are skipped)."""
    out = [ClassStatistics.from_tensors(r.tensors) for r in replies.values() if f"{PREFIX}classes" in r.tensors]
    return [s for s in out if len(s)]


@torch.no_grad()
def extract_features(
    features: Callable[[torch.Tensor], torch.Tensor],
    data: LabeledSubset,
    transform: ImageTransform,
    device: torch.device,
    batch_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features (N,d) float64 on CPU, logit targets (N,)) of `data` through `features(x)`."""
    feats, ys = [], []
    for x, y in data.batches(nograd_batch(device, batch_size), transform, device=device):
        feats.append(features(x).double().cpu())
        ys.append(y.cpu())
    if not feats:
        return torch.zeros(0, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    return torch.cat(feats), torch.cat(ys)


class RunningClassMeans:
    """Per-class sums of features as they stream past (e.g. the training batches of a round, PILoRA's class means
    in both official codes): float64 sums and counts on the features' device, so adding a batch needs no host
    sync; `statistics()` returns the means of the classes seen at least `min_count` times."""

    def __init__(self, num_logits: int) -> None:
        self.num_logits = num_logits
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def add(self, feats: torch.Tensor, targets: torch.Tensor) -> None:
        """Accumulate (N, d) features of logit targets (N,) (detached)."""
        if self.sums is None or self.counts is None:
            self.sums = feats.new_zeros(self.num_logits, feats.shape[1], dtype=torch.float64)
            self.counts = torch.zeros(self.num_logits, dtype=torch.long, device=feats.device)
        self.sums.index_add_(0, targets, feats.detach().double())
        self.counts.index_add_(0, targets, torch.ones_like(targets))

    def statistics(self, min_count: int = 1) -> ClassStatistics:
        """Count and mean (no spread) of every class added at least `min_count` times, on the CPU."""
        if self.sums is None or self.counts is None:
            empty = torch.zeros(0, dtype=torch.long)
            return ClassStatistics(empty, empty, torch.zeros(0, 0))
        sums, counts = self.sums.cpu(), self.counts.cpu()
        keep = (counts >= min_count).nonzero().flatten()
        return ClassStatistics(keep, counts[keep], (sums[keep] / counts[keep].unsqueeze(1)).float())


def summarize(
    feats: torch.Tensor, targets: torch.Tensor, covariance: Covariance = "diag", min_count: int = 2
) -> ClassStatistics:
    """Per-class count, mean and (unbiased) spread of `feats`, for classes with at least `min_count` samples.

    Float64 accumulation, float32 results. Variances need ≥ 2 samples; with `covariance="none"` one suffices.
    """
    if covariance != "none" and min_count < 2:
        raise ValueError("variances need min_count >= 2")
    classes, counts = torch.unique(targets, return_counts=True)
    keep = counts >= min_count
    classes, counts = classes[keep], counts[keep]
    d = feats.shape[1] if feats.dim() == 2 else 0
    means = torch.zeros(len(classes), d, dtype=torch.float64)
    spread = None
    if covariance == "diag":
        spread = torch.zeros(len(classes), d, dtype=torch.float64)
    elif covariance == "full":
        spread = torch.zeros(len(classes), d, d, dtype=torch.float64)
    for i, c in enumerate(classes.tolist()):
        f = feats[targets == c]
        means[i] = f.mean(0)
        if spread is not None:
            centered = f - means[i]
            if covariance == "diag":
                spread[i] = centered.pow(2).sum(0) / (len(f) - 1)
            else:
                spread[i] = centered.T @ centered / (len(f) - 1)
    return ClassStatistics(classes, counts, means.float(), None if spread is None else spread.float())


def class_statistics(
    features: Callable[[torch.Tensor], torch.Tensor],
    data: LabeledSubset,
    transform: ImageTransform,
    device: torch.device,
    covariance: Covariance = "diag",
    min_count: int = 2,
    batch_size: int = 128,
) -> ClassStatistics:
    """Statistics of the features `features(x)` of a client's local data (one pass, no grad)."""
    feats, ys = extract_features(features, data, transform, device, batch_size)
    return summarize(feats, ys, covariance, min_count)


def pooled(stats: list[ClassStatistics]) -> ClassStatistics:
    """Exact per-class statistics of the union of several clients' data (law of total variance; CCVR Eq. 3–4).

    Means are count-weighted; the pooled unbiased spread is [Σ_k (n_k−1)·S_k + Σ_k n_k μ_k μ_kᵀ − N μ μᵀ]/(N−1).
    Classes without a spread on some client (count 1 under `covariance="none"`) only contribute their mean.
    """
    stats = [s for s in stats if len(s)]
    if not stats:
        raise ValueError("no statistics to pool")
    cov = stats[0].covariance
    classes = torch.unique(torch.cat([s.classes for s in stats]))
    d = stats[0].means.shape[1]
    n_out = torch.zeros(len(classes), dtype=torch.long)
    mean_out = torch.zeros(len(classes), d, dtype=torch.float64)
    spread_out = None if cov == "none" else torch.zeros((len(classes), d) + ((d,) if cov == "full" else ()))
    spread_out = None if spread_out is None else spread_out.double()
    pos = {c: i for i, c in enumerate(classes.tolist())}
    for s in stats:
        for j, c in enumerate(s.classes.tolist()):
            n_out[pos[c]] += s.counts[j]
            mean_out[pos[c]] += s.counts[j] * s.means[j].double()
    mean_out /= n_out.unsqueeze(1)
    if spread_out is not None:
        for s in stats:
            for j, c in enumerate(s.classes.tolist()):
                n, mu, sp = int(s.counts[j]), s.means[j].double(), s.spread[j].double()  # type: ignore[index]
                spread_out[pos[c]] += (n - 1) * sp + n * (torch.outer(mu, mu) if cov == "full" else mu * mu)
        for i in range(len(classes)):
            mu, n = mean_out[i], int(n_out[i])
            spread_out[i] -= n * (torch.outer(mu, mu) if cov == "full" else mu * mu)
            spread_out[i] /= max(n - 1, 1)
    return ClassStatistics(classes, n_out, mean_out.float(), None if spread_out is None else spread_out.float())
