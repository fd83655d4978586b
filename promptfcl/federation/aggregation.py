"""Aggregation math shared by every method: (weighted) means of named-tensor dictionaries, the robust rules
(coordinate-wise median, trimmed mean) and update-norm screening that FedAvg-style servers select by config."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RunningMean:
    """Σ_k w_k·state_k / Σ_k w_k, built one state at a time (float64 sums, cast back to each tensor's dtype).

    `weighted_mean` is this over a list; a server that folds replies as they arrive (`Grid.send(..., fold=)`)
    keeps only these sums, not every client's tensors, and gets the same numbers bit for bit.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.total = 0.0
        self.count = 0

    def add(self, state: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        if weight < 0:
            raise ValueError(f"aggregation weights must be non-negative, got {weight}")
        if self.count and state.keys() != self.sums.keys():
            raise ValueError("clients returned different tensor names")
        w = torch.tensor(weight, dtype=torch.float64)
        for name, t in state.items():
            if name not in self.sums:
                self.sums[name] = torch.zeros(t.shape, dtype=torch.float64, device=t.device)
                self.dtypes[name] = t.dtype
            self.sums[name] += w * t.double()
        self.total += float(weight)
        self.count += 1

    def result(self) -> dict[str, torch.Tensor]:
        if not self.count:
            raise ValueError("nothing to aggregate")
        if self.total <= 0:
            raise ValueError("aggregation weights must have a positive sum")
        return {name: (acc / self.total).to(self.dtypes[name]) for name, acc in self.sums.items()}


def weighted_mean(
    states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """Σ_k w_k·state_k / Σ_k w_k for every tensor name (uniform when `weights` is None).

    Sums are taken in float64 and cast back, so the result does not depend on summation order noise.
    """
    if not states:
        raise ValueError("nothing to aggregate")
    w = [1.0] * len(states) if weights is None else [float(x) for x in weights]
    if any(x < 0 for x in w) or sum(w) <= 0:
        raise ValueError(f"aggregation weights must be non-negative with a positive sum, got {w}")
    mean = RunningMean()
    for wk, s in zip(w, states, strict=True):
        mean.add(s, wk)
    return mean.result()


def owner_row_mean(
    previous: torch.Tensor,
    values: Sequence[torch.Tensor],
    owned_rows: Sequence[Sequence[int]],
    weights: Sequence[float] | None = None,
) -> torch.Tensor:
    """Per row, the weighted mean over only the clients that own (trained) that row; other rows keep `previous`.

    For per-(client, task) output slots (Powder/C2Prompt), a head row is trained by the one client whose task owns
    it; averaging it with the untouched copies of the other clients would shrink its update by their number.
    """
    w = [1.0] * len(values) if weights is None else list(weights)
    acc = torch.zeros(previous.shape, dtype=torch.float64, device=previous.device)
    total = torch.zeros(previous.shape[0], dtype=torch.float64, device=previous.device)
    for wk, v, rows in zip(w, values, owned_rows, strict=True):
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=previous.device)
        acc[idx] += wk * v.to(previous.device)[idx].double()
        total[idx] += wk
    out = previous.detach().clone()
    hit = total > 0
    shape = (-1,) + (1,) * (previous.dim() - 1)
    out[hit] = (acc[hit] / total[hit].view(shape)).to(previous.dtype)
    return out


def _stacked(states: Sequence[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    return torch.stack([s[name].double() for s in states])


def _same_names(states: Sequence[dict[str, torch.Tensor]]) -> None:
    if not states:
        raise ValueError("nothing to aggregate")
    if any(s.keys() != states[0].keys() for s in states[1:]):
        raise ValueError("clients returned different tensor names")


def coordinate_median(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Coordinate-wise median (Yin et al., ICML 2018); the mean of the two middle values for an even count."""
    _same_names(states)
    out = {}
    k = len(states)
    for name, ref in states[0].items():
        v = _stacked(states, name).sort(dim=0).values
        med = v[k // 2] if k % 2 else (v[k // 2 - 1] + v[k // 2]) / 2
        out[name] = med.to(ref.dtype)
    return out


def trimmed_mean(states: Sequence[dict[str, torch.Tensor]], fraction: float) -> dict[str, torch.Tensor]:
    """Coordinate-wise trimmed mean: drop the ⌊fraction·K⌋ largest and smallest values, average the rest."""
    _same_names(states)
    if not 0 <= fraction < 0.5:
        raise ValueError(f"trim fraction must be in [0, 0.5), got {fraction}")
    k = len(states)
    cut = min(int(fraction * k), (k - 1) // 2)
    out = {}
    for name, ref in states[0].items():
        v = _stacked(states, name).sort(dim=0).values
        out[name] = v[cut : k - cut].mean(0).to(ref.dtype)
    return out


def aggregate_states(
    states: Sequence[dict[str, torch.Tensor]],
    weights: Sequence[float] | None = None,
    rule: str = "mean",
    trim_fraction: float = 0.1,
) -> dict[str, torch.Tensor]:
    """The configured aggregation rule: weighted mean (FedAvg), coordinate-wise median or trimmed mean.

    The robust rules are unweighted (each client one vote), as in their papers.
    """
    if rule == "mean":
        return weighted_mean(states, weights)
    if rule == "median":
        return coordinate_median(states)
    if rule == "trimmed_mean":
        return trimmed_mean(states, trim_fraction)
    raise ValueError(f"unknown aggregation rule {rule!r} (mean, median, trimmed_mean)")


def update_norms(states: Sequence[dict[str, torch.Tensor]], reference: dict[str, torch.Tensor]) -> list[float]:
    """‖state_k − reference‖₂ over every floating tensor the reference holds (the size of each client's update)."""
    norms = []
    for s in states:
        sq = sum(
            float((s[n].double() - r.double()).pow(2).sum()) for n, r in reference.items() if r.is_floating_point()
        )
        norms.append(sq**0.5)
    return norms


def screen_updates(
    norms: Sequence[float], max_norm: float | None = None, outlier_factor: float | None = None
) -> list[str | None]:
    """Per client, why its update is refused (None: accepted): over `max_norm`, or over `outlier_factor` × the
    median norm of the round (a norm check against scaled or boosted updates)."""
    reasons: list[str | None] = []
    med = float(torch.tensor(list(norms), dtype=torch.float64).median()) if norms else 0.0
    for n in norms:
        if max_norm is not None and n > max_norm:
            reasons.append(f"update norm {n:.4g} over the limit {max_norm:g} (method.aggregation.max_update_norm)")
        elif outlier_factor is not None and len(norms) > 2 and n > outlier_factor * med:
            reasons.append(
                f"update norm {n:.4g} over {outlier_factor:g} × the round's median {med:.4g} "
                "(method.aggregation.norm_outlier_factor)"
            )
        else:
            reasons.append(None)
    return reasons
