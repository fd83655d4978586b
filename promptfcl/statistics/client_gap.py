"""How far apart two clients' features of the same class lie: the cross-client gap C2Prompt's LCDC compensates.

For a class c held by clients a and b, with n_a, n_b samples of the frozen unprompted feature q(x):

    gap_c(a, b) = ‖μ_a − μ_b‖ / s,   s² = (Σ_{x∈a} ‖x − μ_a‖² + Σ_{x∈b} ‖x − μ_b‖²) / (n_a + n_b − 2)

the distance between the two clients' class means in units of the within-class spread (s² estimates tr Σ). If both
clients drew their images from one distribution, E‖μ_a − μ_b‖² = tr Σ · (1/n_a + 1/n_b), so the sampling floor of
the gap is `floor_c = √(1/n_a + 1/n_b)` (≈ 0.32 for 20 images each): a gap near its floor means nothing to
compensate. For scale, `between_class` is the same ratio for two *different* classes of one client.

`client_class_features` collects q(x) of the training images a scenario's clients hold of the classes several of
them share, through each client's `LabeledSubset` (so in its image domain, `scenario.domains`, unless
`domains=False`): what `benchmarks/domain_gap.py` measures on CIFAR-100 and `tests/test_client_domains.py` on
synthetic images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np
import torch

from promptfcl.data.base import ImageSplit
from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import ImageTransform
from promptfcl.scenario.scenario import Scenario


@dataclass
class ClientGap:
    """Mean over (class, client pair) of the gap and its sampling floor; mean over class pairs of `between_class`."""

    gap: float
    floor: float
    between_class: float
    pairs: int
    samples: int
    per_pair: list[dict[str, Any]] = field(default_factory=list)  # {class, clients, gap, floor} of each pair

    def as_dict(self) -> dict[str, Any]:
        return {
            "gap": self.gap,
            "floor": self.floor,
            "gap_over_floor": self.gap / self.floor if self.floor else float("nan"),
            "between_class": self.between_class,
            "pairs": self.pairs,
            "samples": self.samples,
            "per_pair": self.per_pair,
        }


def _ratio(x: torch.Tensor, y: torch.Tensor) -> float:
    mx, my = x.mean(0), y.mean(0)
    within = (((x - mx) ** 2).sum() + ((y - my) ** 2).sum()) / (len(x) + len(y) - 2)
    return float((mx - my).norm() / within.sqrt())


def client_class_gap(features: torch.Tensor, classes: torch.Tensor, clients: torch.Tensor) -> ClientGap:
    """The mean gap over every class and every pair of clients holding ≥ 2 samples of it (features (N, d) float)."""
    f = features.double()
    gaps, floors, between, per_pair = [], [], [], []
    groups: dict[int, dict[int, torch.Tensor]] = {}
    for c in classes.unique().tolist():
        for k in clients[classes == c].unique().tolist():
            sel = (classes == c) & (clients == k)
            if int(sel.sum()) >= 2:
                groups.setdefault(int(c), {})[int(k)] = f[sel]
    for c, by_client in groups.items():
        for a, b in combinations(sorted(by_client), 2):
            x, y = by_client[a], by_client[b]
            gaps.append(_ratio(x, y))
            floors.append(float(np.sqrt(1 / len(x) + 1 / len(y))))
            per_pair.append({"class": c, "clients": [a, b], "gap": gaps[-1], "floor": floors[-1]})
    for c, d in combinations(sorted(groups), 2):  # two classes of one client (no domain between them)
        shared = sorted(set(groups[c]) & set(groups[d]))
        if shared:
            between.append(_ratio(groups[c][shared[0]], groups[d][shared[0]]))
    nan = float("nan")
    return ClientGap(
        float(np.mean(gaps)) if gaps else nan,
        float(np.mean(floors)) if floors else nan,
        float(np.mean(between)) if between else nan,
        len(gaps),
        int(sum(len(x) for g in groups.values() for x in g.values())),
        per_pair,
    )


def shared_class_holdings(scenario: Scenario, train_targets: np.ndarray) -> dict[int, dict[int, np.ndarray]]:
    """class → client → the training images of that class the client trains on (scheduled tasks), for the classes
    at least two clients train on."""
    held: dict[int, dict[int, set[int]]] = {}
    for stage in range(scenario.num_tasks):
        for k in range(scenario.num_clients):
            idx = scenario.client_indices(stage, k)
            for c in np.unique(train_targets[idx]).tolist():
                held.setdefault(int(c), {}).setdefault(k, set()).update(idx[train_targets[idx] == c].tolist())
    return {
        c: {k: np.array(sorted(v), dtype=np.int64) for k, v in sorted(by.items())}
        for c, by in sorted(held.items())
        if len(by) >= 2
    }


@torch.no_grad()
def client_class_features(
    query: Any,
    scenario: Scenario,
    train: ImageSplit,
    transform: ImageTransform,
    device: torch.device,
    max_classes: int | None = None,
    max_clients: int = 2,
    per_client: int | None = None,
    domains: bool = True,
    batch_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features, real classes, clients) of q(x) = `query(images)` on the images clients hold of shared classes: the
    first `max_classes` such classes, the first `max_clients` clients holding each, the first `per_client` images of
    each; each client's images in its own domain (`domains=False`: as stored, for the no-domain control)."""
    targets = train.targets.numpy()
    feats, ys, ks = [], [], []
    identity = torch.arange(int(targets.max()) + 1)
    for by_client in list(shared_class_holdings(scenario, targets).values())[:max_classes]:
        for k, idx in list(by_client.items())[:max_clients]:
            domain = scenario.client_domain(k) if domains else None
            sub = LabeledSubset.of(train, idx[:per_client], identity, domain)
            for x, y in sub.batches(nograd_batch(device, batch_size), transform, device=device):
                feats.append(query(x).float().cpu())
                ys.append(y.cpu())
                ks.append(torch.full((len(y),), k, dtype=torch.long))
    if not feats:
        raise ValueError("no class is trained on by two clients in this scenario; nothing to compare")
    return torch.cat(feats), torch.cat(ys), torch.cat(ks)
