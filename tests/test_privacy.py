"""The Gaussian mechanism on uploaded statistics: calibration, clipping, noise scale, and real runs with it on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from promptfcl.config import build_config
from promptfcl.experiment import Experiment
from promptfcl.statistics.class_stats import summarize
from promptfcl.statistics.privacy import (
    PrivacyParams,
    clip_rows,
    gaussian_delta,
    gaussian_sigma,
    private_class_statistics,
    private_counts,
    unit_noise_sigma,
)

from .conftest import tiny_raw


@pytest.mark.parametrize("eps", [0.1, 0.5, 1.0, 4.0])
def test_sigma_is_the_smallest_noise_meeting_epsilon_delta(eps: float) -> None:
    delta = 1e-5
    s = gaussian_sigma(eps, delta)
    assert gaussian_delta(s, eps) <= delta < gaussian_delta(0.999 * s, eps)  # tight: less noise breaks (ε, δ)
    assert gaussian_sigma(eps, delta, 3.0) == pytest.approx(3 * s, rel=1e-6)  # linear in the sensitivity
    if eps < 1:  # never more noise than the classical bound Δ·√(2 ln(1.25/δ))/ε (Dwork & Roth, Thm. A.1)
        assert s <= math.sqrt(2 * math.log(1.25 / delta)) / eps


def test_releases_compose_as_one_release_at_sqrt_k_sensitivity() -> None:
    p1 = PrivacyParams(epsilon=1.0, clip=1.0, releases=1)
    p4 = PrivacyParams(epsilon=1.0, clip=1.0, releases=4)
    assert unit_noise_sigma(p4, 3) == pytest.approx(2 * unit_noise_sigma(p1, 3), rel=1e-6)


def test_epsilon_without_a_clipping_bound_is_refused() -> None:
    from promptfcl.config import ConfigError
    from promptfcl.runtime import check_config

    raw = tiny_raw()
    raw["method"] = {"name": "hgp", "layers": [0, 1], "privacy": {"epsilon": 1.0}}
    with pytest.raises(ConfigError, match="method.privacy: Value error, set privacy.clip"):
        check_config(build_config(raw))


def test_clipping_bounds_what_one_sample_can_change() -> None:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(50, 8, generator=g, dtype=torch.float64)
    outlier = torch.full((1, 8), 1e6, dtype=torch.float64)
    before = clip_rows(feats, 1.0).sum(0)
    after = clip_rows(torch.cat([feats, outlier]), 1.0).sum(0)
    assert (after - before).norm() <= 1.0 + 1e-9
    assert (clip_rows(feats, 1.0).norm(dim=1) <= 1.0 + 1e-9).all()


def test_label_count_noise_has_the_calibrated_scale() -> None:
    p = PrivacyParams(epsilon=1.0, delta=1e-5, clip=1.0)
    counts = torch.full((20000,), 1000, dtype=torch.long)
    noisy = private_counts(counts, p, torch.Generator().manual_seed(1))
    assert noisy.dtype == torch.long and (noisy >= 0).all()
    assert (noisy - counts).double().std().item() == pytest.approx(gaussian_sigma(1.0, 1e-5), rel=0.03)


@pytest.mark.parametrize("covariance", ["diag", "full", "none"])
def test_private_statistics_are_noisy_but_unbiased_for_large_epsilon(covariance: str) -> None:
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(400, 6, generator=g, dtype=torch.float64) * 0.1 + 0.2
    ys = torch.arange(2).repeat_interleave(200)
    exact = summarize(clip_rows(feats, 1.0), ys, covariance, 2)
    quiet = private_class_statistics(feats, ys, [0, 1, 2], covariance, 2, PrivacyParams(epsilon=1e4, clip=1.0), g)
    assert quiet.classes.tolist() == [0, 1]  # class 2 (absent) is released as noise, then dropped by its count
    assert torch.allclose(quiet.means, exact.means, atol=1e-3)
    loud = private_class_statistics(feats, ys, [0, 1, 2], covariance, 2, PrivacyParams(epsilon=0.5, clip=1.0), g)
    assert not torch.allclose(loud.means[:2], exact.means, atol=1e-3)  # real noise at a real budget
    if covariance == "full":
        assert (torch.linalg.eigvalsh(loud.spread.double()) >= -1e-6).all()  # type: ignore[union-attr]
    elif covariance == "diag":
        assert (loud.spread >= 0).all()  # type: ignore[operator]


@pytest.mark.parametrize("method", ["hgp", "hepco"])
def test_runs_with_private_uploads_pass_validation(method: str, tmp_path: Path) -> None:
    raw = tiny_raw(scenario={"num_tasks": 1, "rounds_per_task": 1})
    raw["method"] = {
        "name": method, "layers": [0, 1], "local_epochs": 1, "batch_size": 8, "lr": 0.01,
        "privacy": {"epsilon": 1.0, "delta": 1e-5, "clip": 5.0, "releases": 1},
    }  # fmt: skip
    if method == "hgp":
        raw["method"]["length"] = 4
    else:
        raw["method"].update(augment="flip", pool_size=8, length=4, generator_iterations=2, kd_iterations=2)
    exp = Experiment(build_config(raw), tmp_path, show_progress=False)
    metrics = exp.run()
    rounds = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert rounds[0]["failures"] == [] and rounds[0]["clients"] == 3 and metrics["accuracy_matrix"]
