"""The shared K-means (`promptfcl.federation.clustering.kmeans`): k-means++ seeds, Lloyd iterations to a fixed
point, deterministic for a seed, and no scikit-learn needed (CAPT's default clusterer runs on the core install)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from promptfcl.federation.clustering import cluster_rows, kmeans


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return all((a[i] == a[j]) == (b[i] == b[j]) for i in range(len(a)) for j in range(len(a)))


def test_kmeans_recovers_separated_blobs_of_unequal_sizes() -> None:
    rng = np.random.default_rng(0)
    centres, sizes = np.array([[0.0, 0.0], [5.0, 5.0], [0.0, 8.0]]), [20, 4, 12]
    x = np.concatenate([c + 0.3 * rng.standard_normal((n, 2)) for c, n in zip(centres, sizes, strict=True)])
    truth = np.repeat(np.arange(3), sizes)
    for seed in range(5):
        assert same_partition(kmeans(x, 3, seed), truth)


def test_kmeans_ends_at_a_lloyd_fixed_point_and_is_deterministic() -> None:
    """Every point's nearest cluster mean is its own cluster's (the converged Lloyd partition), the best restart
    is kept, and the same input and seed give the same labels."""
    y = np.random.default_rng(1).random((60, 3))
    for seed in (0, 3, 11):
        labels = kmeans(y, 5, seed)
        ids = np.unique(labels)
        means = np.stack([y[labels == j].mean(0) for j in ids])
        nearest = ids[((y[:, None, :] - means[None]) ** 2).sum(2).argmin(1)]
        assert (nearest == labels).all()
        assert (kmeans(y, 5, seed) == labels).all()
        inertia = lambda lab: sum(((y[lab == j] - y[lab == j].mean(0)) ** 2).sum() for j in np.unique(lab))  # noqa: E731
        assert inertia(labels) <= inertia(kmeans(y, 5, seed, n_init=1)) + 1e-12  # best of 10 ≤ one restart


def test_cluster_rows_kmeans_needs_no_scikit_learn() -> None:
    code = (
        "import sys, numpy as np; from promptfcl.federation.clustering import cluster_rows; "
        "cluster_rows(np.random.default_rng(0).random((8, 8)), 3); assert 'sklearn' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert len(set(cluster_rows(np.eye(4).repeat(2, axis=0), 4).tolist())) == 4  # duplicate rows share a cluster
