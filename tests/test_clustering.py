"""CAPT's row clustering (`promptfcl.methods.capt.clustering.cluster_rows`): scikit-learn's K-means on the rows,
deterministic for a seed, relabelled by first appearance, degenerate inputs handled before the clusterer."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sklearn", reason="CAPT's clustering needs scikit-learn: pip install 'promptfcl[clip]'")

from promptfcl.methods.capt.clustering import cluster_rows  # noqa: E402


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return all((a[i] == a[j]) == (b[i] == b[j]) for i in range(len(a)) for j in range(len(a)))


def test_kmeans_recovers_separated_blobs_of_unequal_sizes() -> None:
    rng = np.random.default_rng(0)
    centres, sizes = np.array([[0.0, 0.0], [5.0, 5.0], [0.0, 8.0]]), [20, 4, 12]
    x = np.concatenate([c + 0.3 * rng.standard_normal((n, 2)) for c, n in zip(centres, sizes, strict=True)])
    truth = np.repeat(np.arange(3), sizes)
    for seed in range(5):
        assert same_partition(cluster_rows(x, 3, "kmeans", seed), truth)


def test_kmeans_is_a_lloyd_fixed_point_deterministic_and_relabelled_by_first_appearance() -> None:
    """Every row's nearest cluster mean is its own cluster's, the same input and seed give the same labels, and
    labels count up in order of first appearance."""
    y = np.random.default_rng(1).random((60, 3))
    for seed in (0, 3, 11):
        labels = cluster_rows(y, 5, "kmeans", seed)
        ids = np.unique(labels)
        means = np.stack([y[labels == j].mean(0) for j in ids])
        nearest = ids[((y[:, None, :] - means[None]) ** 2).sum(2).argmin(1)]
        assert (nearest == labels).all()
        assert (cluster_rows(y, 5, "kmeans", seed) == labels).all()
        firsts = [int(np.flatnonzero(labels == j)[0]) for j in ids]
        assert firsts == sorted(firsts)


def test_degenerate_inputs_give_one_cluster_per_distinct_row() -> None:
    assert len(set(cluster_rows(np.eye(4).repeat(2, axis=0), 4).tolist())) == 4  # duplicate rows share a cluster
    assert set(cluster_rows(np.ones((5, 3)), 3).tolist()) == {0}  # identical rows: one cluster
