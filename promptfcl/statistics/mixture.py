"""Server-side Gaussian class mixtures and an O(1)-per-draw hierarchical feature sampler.

HGP (§3.2–3.3, Eq. 4–6): each class c is a mixture over clients of N(μ_{m,c}, Σ_{m,c}) with weights
π_{m,c} = n_{m,c} / Σ_m n_{m,c}; a feature is drawn class → client component → Gaussian. CCVR uses the same
store with one pooled component per class. Categorical draws use Walker/Vose alias tables (one uniform index
and one coin per draw, the "O(1) sampling" HGP's paper describes), vectorised over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from promptfcl.statistics.class_stats import ClassStatistics

ClassWeights = Literal["counts", "uniform"]


def alias_tables(probs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Vose alias tables for each row of `probs` (R, K) (rows need not be normalised; zeros are padding).

    Returns (accept (R,K) float64, alias (R,K) long): draw slot i uniformly, keep it with probability
    accept[r,i], else take alias[r,i]. Exact for every row.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or (probs < 0).any() or (probs.sum(1) <= 0).any():
        raise ValueError("alias tables need a (R, K) array of non-negative rows with positive sums")
    r_count, k = probs.shape
    accept = np.ones((r_count, k))
    alias = np.tile(np.arange(k), (r_count, 1))
    for r in range(r_count):
        scaled = probs[r] / probs[r].sum() * k
        small = [i for i in range(k) if scaled[i] < 1.0]
        large = [i for i in range(k) if scaled[i] >= 1.0]
        while small and large:
            s, g = small.pop(), large.pop()
            accept[r, s], alias[r, s] = scaled[s], g
            scaled[g] -= 1.0 - scaled[s]
            (small if scaled[g] < 1.0 else large).append(g)
        for i in small + large:  # numerical leftovers are certain
            accept[r, i] = 1.0
    return torch.from_numpy(accept), torch.from_numpy(alias)


def alias_draw(accept: torch.Tensor, alias: torch.Tensor, rows: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw per entry of `rows` from the alias tables: two uniforms each, no per-draw loop."""
    n, k = rows.numel(), accept.shape[1]
    slot = torch.randint(k, (n,), generator=gen)
    coin = torch.rand(n, generator=gen, dtype=torch.float64)
    keep = coin < accept[rows, slot]
    return torch.where(keep, slot, alias[rows, slot])


@dataclass
class GaussianComponents:
    """A flat store of Gaussian components: which task and class each belongs to, its count, mean, spread.

    `spread` is (K,d) diagonal variances or (K,d,d) covariances. HGP keeps one component per (client, class);
    components of a task are replaced as a whole (current task every round; old tasks frozen at their last
    round).
    """

    task: torch.Tensor
    cls: torch.Tensor
    count: torch.Tensor
    mean: torch.Tensor
    spread: torch.Tensor

    @classmethod
    def empty(cls, dim: int, full: bool = False) -> GaussianComponents:
        z = torch.zeros(0, dtype=torch.long)
        return cls(z, z.clone(), z.clone(), torch.zeros(0, dim), torch.zeros((0, dim, dim) if full else (0, dim)))

    def __len__(self) -> int:
        return int(self.cls.numel())

    def replace_task(self, task: int, stats: list[ClassStatistics]) -> GaussianComponents:
        """These components with task `task`'s replaced by one component per (statistics entry, class)."""
        stats = [s for s in stats if len(s)]
        keep = self.task != task
        parts = [(self.task[keep], self.cls[keep], self.count[keep], self.mean[keep], self.spread[keep])]
        for s in stats:
            if s.spread is None or s.spread.shape[1:] != self.spread.shape[1:]:
                raise ValueError(
                    f"statistics with spread {None if s.spread is None else tuple(s.spread.shape)} "
                    f"do not fit components of spread shape {tuple(self.spread.shape[1:])}"
                )
            parts.append((torch.full_like(s.classes, task), s.classes, s.counts, s.means, s.spread))
        return GaussianComponents(*(torch.cat([p[i] for p in parts]) for i in range(5)))

    def classes(self) -> torch.Tensor:
        return torch.unique(self.cls)

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        names = ("task", "cls", "count", "mean", "spread")
        return {f"{prefix}{n}": getattr(self, n) for n in names}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> GaussianComponents:
        return cls(*(tensors[f"{prefix}{n}"] for n in ("task", "cls", "count", "mean", "spread")))


class MixtureSampler:
    """Draws (feature, class) pairs hierarchically from the components of chosen classes.

    Class c ~ Cat(ω) with ω_c ∝ Σ_m n_{m,c} (`class_weights="counts"`, HGP paper Eq. 6) or uniform (HGP
    code); component m ~ Cat(π_{·,c}) with π ∝ n_{m,c}; feature ~ N(μ, scale·Σ + eps·I). The spread is
    inflated by `variance_scale` (3 in HGP for diagonal spreads) before sampling.
    """

    def __init__(
        self,
        comps: GaussianComponents,
        classes: torch.Tensor | list[int],
        class_weights: ClassWeights = "counts",
        variance_scale: float = 1.0,
        eps: float = 1e-8,
    ) -> None:
        classes = torch.as_tensor(classes, dtype=torch.long)
        sel = torch.isin(comps.cls, classes)
        if not sel.any():
            raise ValueError("no Gaussian components for the requested classes")
        self.classes = torch.unique(comps.cls[sel])
        self.comp_mean = comps.mean[sel].double()
        comp_cls, comp_count = comps.cls[sel], comps.count[sel].double()
        spread = comps.spread[sel].double() * variance_scale
        if spread.dim() == 2:
            self.comp_scale = (spread + eps).sqrt()  # (K,d) standard deviations
        else:  # (K,d,d): a square root of Σ that tolerates rank deficiency (n < d)
            d = spread.shape[-1]
            evals, evecs = torch.linalg.eigh(spread + eps * torch.eye(d, dtype=spread.dtype))
            self.comp_scale = evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)
        # per class: its component ids (padded) and their weights π
        rows = [torch.nonzero(comp_cls == c).flatten() for c in self.classes.tolist()]
        width = max(len(r) for r in rows)
        self.slot_comp = torch.zeros(len(rows), width, dtype=torch.long)
        weights = np.zeros((len(rows), width))
        for i, r in enumerate(rows):
            self.slot_comp[i, : len(r)] = r
            weights[i, : len(r)] = comp_count[r].numpy()
        self.comp_accept, self.comp_alias = alias_tables(weights)
        class_w = weights.sum(1) if class_weights == "counts" else np.ones(len(rows))
        self.class_probs = torch.from_numpy(class_w / class_w.sum())
        self.class_accept, self.class_alias = alias_tables(class_w[None, :])

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` features (n,d) float32 and their class logit ids (n,)."""
        zero = torch.zeros(n, dtype=torch.long)
        row = alias_draw(self.class_accept, self.class_alias, zero, gen)
        slot = alias_draw(self.comp_accept, self.comp_alias, row, gen)
        comp = self.slot_comp[row, slot]
        z = torch.randn(n, self.comp_mean.shape[1], generator=gen, dtype=torch.float64)
        if self.comp_scale.dim() == 2:
            noise = z * self.comp_scale[comp]
        else:  # one matrix product per component present (never an (n,d,d) gather)
            noise = torch.empty_like(z)
            for k in torch.unique(comp).tolist():
                idx = comp == k
                noise[idx] = z[idx] @ self.comp_scale[k].T
        return (self.comp_mean[comp] + noise).float(), self.classes[row]
