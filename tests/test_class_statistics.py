"""Class statistics, pooled moments and the hierarchical alias sampler (HGP §3.2–3.3, CCVR §4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from promptfcl.statistics import ClassStatistics, GaussianComponents, MixtureSampler, alias_tables, pooled, summarize


@pytest.mark.parametrize("row", [[0.5, 0.25, 0.25], [1, 0, 0, 3], [0.1, 0.2, 0.3, 0.4, 0.0], [7.0]])
def test_alias_tables_are_exact(row: list[float]) -> None:
    accept, alias = alias_tables(np.array([row]))
    k = len(row)
    prob = accept[0].clone() / k
    for j in range(k):  # slot j hands its rejected mass to alias[j]
        prob[alias[0, j]] += (1 - accept[0, j]) / k
    expected = torch.tensor(row, dtype=torch.float64) / sum(row)
    assert torch.allclose(prob, expected, atol=1e-12)


def test_summarize_matches_direct_moments() -> None:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(50, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0] * 20 + [3] * 29 + [5])
    s = summarize(feats, y, "diag", min_count=2)
    assert s.classes.tolist() == [0, 3] and s.counts.tolist() == [20, 29]  # class 5 has one sample: not uploaded
    assert torch.allclose(s.means[1].double(), feats[20:49].mean(0), atol=1e-6)
    assert torch.allclose(s.spread[1].double(), feats[20:49].var(0, unbiased=True), atol=1e-6)
    full = summarize(feats, y, "full")
    assert torch.allclose(full.spread[0].double(), torch.cov(feats[:20].T), atol=1e-6)


@pytest.mark.parametrize("cov", ["diag", "full"])
def test_pooled_statistics_equal_statistics_of_the_union(cov: str) -> None:
    """CCVR Eq. 3–4: the server's pooled mean/covariance equal those of all clients' data together."""
    g = torch.Generator().manual_seed(1)
    parts = []
    for shift, n in [(0.0, 12), (2.0, 7), (-1.0, 30)]:
        f = torch.randn(n, 5, generator=g, dtype=torch.float64) * (1 + shift**2) + shift
        y = torch.arange(n) % 3  # every class at least twice on every client
        parts.append((f, y))
    union = summarize(torch.cat([f for f, _ in parts]), torch.cat([y for _, y in parts]), cov)  # type: ignore[arg-type]
    merged = pooled([summarize(f, y, cov) for f, y in parts])  # type: ignore[arg-type]
    assert merged.classes.tolist() == union.classes.tolist()
    assert merged.counts.tolist() == union.counts.tolist()
    assert torch.allclose(merged.means, union.means, atol=1e-5)
    assert torch.allclose(merged.spread, union.spread, atol=1e-4)


def _components() -> GaussianComponents:
    """Class 4: two client components (counts 30, 10); class 7: three (5, 5, 10); class 9: one (40)."""
    d = 3
    cls = torch.tensor([4, 4, 7, 7, 7, 9])
    count = torch.tensor([30, 10, 5, 5, 10, 40])
    mean = torch.tensor([[0, 0, 0], [4, 0, -2], [1, 1, 1], [-3, 2, 0], [0, 5, 5], [10, 10, 10.0]])
    var = torch.tensor([[1, 1, 1], [0.25, 2, 1], [1, 1, 1], [0.5, 0.5, 0.5], [2, 1, 0.1], [1, 4, 9.0]])
    return GaussianComponents(torch.zeros(6, dtype=torch.long), cls, count, mean, var.reshape(6, d))


@pytest.mark.parametrize("weights", ["counts", "uniform"])
def test_hierarchical_sampler_matches_the_mixture(weights: str) -> None:
    comps = _components()
    scale = 3.0
    sampler = MixtureSampler(comps, [4, 7, 9], weights, variance_scale=scale)  # type: ignore[arg-type]
    n = 300_000
    feats, labels = sampler.sample(n, torch.Generator().manual_seed(0))
    totals = {4: 40, 7: 20, 9: 40}
    omega = {c: (t / 100 if weights == "counts" else 1 / 3) for c, t in totals.items()}
    for c, w in omega.items():
        freq = (labels == c).double().mean().item()
        assert abs(freq - w) < 4 * (w * (1 - w) / n) ** 0.5 + 1e-3, (c, freq, w)
        sel = comps.cls == c
        pi = comps.count[sel].double() / comps.count[sel].sum()
        mu, var = comps.mean[sel].double(), comps.spread[sel].double() * scale
        mix_mean = (pi[:, None] * mu).sum(0)
        mix_var = (pi[:, None] * (var + mu**2)).sum(0) - mix_mean**2
        got = feats[labels == c].double()
        assert torch.allclose(got.mean(0), mix_mean, atol=0.08), (c, got.mean(0), mix_mean)
        assert torch.allclose(got.var(0), mix_var, rtol=0.05, atol=0.08), (c, got.var(0), mix_var)
    # component frequencies within class 7: nearest component mean identifies the component (well separated)
    f7 = feats[labels == 7]
    comp_ids = torch.cdist(f7, comps.mean[2:5]).argmin(1)
    freq = torch.bincount(comp_ids, minlength=3).double() / len(f7)
    assert torch.allclose(freq, torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64), atol=0.03)


def test_full_covariance_sampling_reproduces_the_covariance() -> None:
    a = torch.tensor([[2.0, 0.0, 0.0], [1.5, 0.5, 0.0], [0.0, -1.0, 0.3]])
    cov = a @ a.T
    comps = GaussianComponents(
        torch.zeros(1, dtype=torch.long), torch.tensor([2]), torch.tensor([9]), torch.ones(1, 3), cov[None]
    )
    feats, _ = MixtureSampler(comps, [2], variance_scale=3.0).sample(200_000, torch.Generator().manual_seed(3))
    assert torch.allclose(torch.cov(feats.double().T), 3 * cov.double(), atol=0.1)


def test_replacing_a_task_keeps_older_tasks() -> None:
    comps = GaussianComponents.empty(2)
    s0 = ClassStatistics(torch.tensor([0, 1]), torch.tensor([5, 6]), torch.zeros(2, 2), torch.ones(2, 2))
    s1 = ClassStatistics(torch.tensor([2]), torch.tensor([3]), torch.ones(1, 2), torch.ones(1, 2))
    comps = comps.replace_task(0, [s0, s0]).replace_task(1, [s1]).replace_task(1, [s1, s1])
    assert comps.cls.tolist() == [0, 1, 0, 1, 2, 2]
    assert comps.task.tolist() == [0, 0, 0, 0, 1, 1]
    back = GaussianComponents.from_tensors(comps.to_tensors("g/"), "g/")
    assert torch.equal(back.mean, comps.mean) and torch.equal(back.cls, comps.cls)
