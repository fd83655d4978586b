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


def classwise_mean(
    rows: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-class weighted mean of class-indexed tensors (C, ...): row c = Σ_k n_k(c)·X_k[c] / Σ_k n_k(c).

    For class-aware prompts only the clients holding class c trained row c, so they alone set it. Rows that no
    client holds take `keep[c]` when given (the previous value), else the uniform mean. Sums in float64.
    """
    if not rows:
        raise ValueError("nothing to aggregate")
    x = torch.stack([r.double() for r in rows])  # (K, C, ...)
    n = torch.stack([c.double() for c in counts])  # (K, C)
    if n.shape != x.shape[:2] or (n < 0).any():
        raise ValueError(f"counts must be non-negative with shape (clients, classes) = {tuple(x.shape[:2])}")
    n = n.to(x.device)  # label counts come from the CPU, the rows may sit on a GPU
    total = n.sum(0)
    w = n.view(*n.shape, *([1] * (x.ndim - 2)))
    mean = (w * x).sum(0) / total.clamp_min(1e-300).view(-1, *([1] * (x.ndim - 2)))
    fallback = keep.to(x.device, torch.float64) if keep is not None else x.mean(0)
    held = (total > 0).view(-1, *([1] * (x.ndim - 2)))
    return torch.where(held, mean, fallback).to(rows[0].dtype)


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


def class_affinity_weights(hist: torch.Tensor, temperature: float, norm: str = "centered_l2") -> torch.Tensor:
    """C2Prompt's CPA weights W = row-softmax(H Hᵀ / τ) for stacked prompt-class histograms H (rows, classes).

    `norm` (the sources are silent): `centered_l2` subtracts from every row the mean row of its client block
    (pass `hist` as (clients, N, classes) for that) and L2-normalises rows, so H Hᵀ is the cosine of relative
    class affinities; `l2` L2-normalises raw rows; `l1` divides rows by their absolute sum; `none` uses H as is.
    Returns (rows, rows) with rows summing to one.
    """
    h = hist.double()
    if norm == "centered_l2":
        if h.dim() != 3:
            raise ValueError("centered_l2 needs the histograms as (clients, components, classes)")
        h = h - h.mean(dim=1, keepdim=True)
    h = h.reshape(-1, h.shape[-1])
    if norm in ("centered_l2", "l2"):
        h = torch.nn.functional.normalize(h, dim=1)
    elif norm == "l1":
        h = h / h.abs().sum(dim=1, keepdim=True).clamp_min(1e-12)
    elif norm != "none":
        raise ValueError(f"unknown histogram normalisation {norm!r}")
    return torch.softmax(h @ h.T / temperature, dim=1)


def mix_rows(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """W · P for stacked rows P (R, …): every output row a convex combination of the inputs (float64 sums)."""
    flat = rows.reshape(rows.shape[0], -1).double()
    return (weights.to(flat.device, torch.float64) @ flat).reshape(rows.shape).to(rows.dtype)


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


def regularize_gram(gram: torch.Tensor, decay: float) -> torch.Tensor:
    """RegMean's off-diagonal decay (Jin et al., ICLR 2023, §3.3): γ·G + (1 − γ)·diag(G). γ = 1 keeps G; γ = 0
    keeps only its diagonal, returned as the (n,) vector of that diagonal (all a diagonal Gram needs to travel)."""
    if not 0 <= decay <= 1:
        raise ValueError(f"Gram decay must be in [0, 1], got {decay}")
    if decay == 0:
        return gram.diagonal().clone() if gram.dim() == 2 else gram
    if gram.dim() == 1:
        raise ValueError("a diagonal Gram cannot be regularised with decay > 0 (its off-diagonals were not kept)")
    return decay * gram + (1 - decay) * torch.diag_embed(gram.diagonal())


def project_gram(a: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """A·G·Aᵀ for A (r, n) and a full (n, n) or diagonal (n,) Gram, in float64: the Gram of the inputs A·x."""
    g = gram.double()
    a = a.to(g.device, torch.float64)  # on the Gram's device (clients send Grams from the CPU)
    return (a * g) @ a.T if g.dim() == 1 else a @ g @ a.T


def regmean(weights: Sequence[torch.Tensor], grams: Sequence[torch.Tensor]) -> torch.Tensor:
    """RegMean's closed-form merge W* = (Σ_k W_k·G_k)·(Σ_k G_k)⁺ of linear maps W_k (m, n) whose inputs have Gram
    matrices G_k = X_kᵀX_k (n, n) — the minimiser of Σ_k ‖X_k·W*ᵀ − X_k·W_kᵀ‖²_F. A diagonal Gram may be given
    as its (n,) diagonal (all must then be diagonal): every input column is then a weighted mean. Solved in
    float64 with a pseudo-inverse (a direction no client's inputs reach gets 0), returned in W_0's dtype."""
    if not weights or len(weights) != len(grams):
        raise ValueError(f"regmean needs one Gram per weight, got {len(weights)} weights and {len(grams)} Grams")
    diagonal = grams[0].dim() == 1
    if any((g.dim() == 1) != diagonal for g in grams):
        raise ValueError("regmean: mix of diagonal and full Gram matrices")
    dev = grams[0].device  # solved where the Grams are; returned on W_0's device
    gs = [g.to(dev, torch.float64) for g in grams]
    ws = [w.to(dev, torch.float64) for w in weights]
    total = torch.stack(gs).sum(0)
    if diagonal:
        num = torch.stack([w * g for w, g in zip(ws, gs, strict=True)]).sum(0)
        inv = torch.where(total > 0, 1.0 / total.clamp_min(1e-300), torch.zeros_like(total))
        return (num * inv).to(weights[0].device, weights[0].dtype)
    num = torch.stack([w @ g for w, g in zip(ws, gs, strict=True)]).sum(0)
    return (num @ torch.linalg.pinv(total, hermitian=True)).to(weights[0].device, weights[0].dtype)


def prototype_reweight(
    prototypes: torch.Tensor, features: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PILoRA's prototype re-weighting of one class (Guo et al., ECCV 2024, §3.2; official `compute_weight`).

    `prototypes` (K, d): the class's prototype as trained by each of K clients; `features` (J, d): the class's
    mean feature on each of the J clients that hold it. Client k's prototype is scored by the reciprocal of its
    summed Euclidean distance to those features, s_k = 1 / Σ_j ‖m_k − f_j‖₂, scores are min-max normalised and
    w = softmax(ŝ / τ); the global prototype is Σ_k w_k·m_k. Without features (or with equal scores) every
    prototype weighs the same. Returns (global prototype (d,), weights (K,)), float64 sums, prototypes' dtype.
    """
    k = prototypes.shape[0]
    if k == 0:
        raise ValueError("no prototypes to re-weight")
    p = prototypes.double()
    if features.shape[0] == 0:
        w = torch.full((k,), 1.0 / k, dtype=torch.float64, device=p.device)
    else:
        score = 1.0 / torch.cdist(p, features.to(p.device, torch.float64)).sum(1).clamp_min(1e-12)
        span = score.max() - score.min()
        norm = (score - score.min()) / span if span > 0 else torch.zeros_like(score)
        w = torch.softmax(norm / temperature, dim=0)
    return (w @ p).to(prototypes.dtype), w
