"""Server-side client clustering from label distributions (CAPT §3.3, App. D): distances, complementarity,
pluggable clusterers: scikit-learn's K-means (CAPT's clusterer, the default: k-means++ seeds, best of 10 restarts,
seeded) and the alternatives of App. D (agglomerative, GMM, spectral); scikit-learn comes with the
`promptfcl[clip]` extra every CAPT run installs.

- `pairwise_distance(d, metric)`: (n, n) matrix between clients' normalised label distributions; metrics `js`
  (CAPT Eq. 5, natural log), `kl` (symmetrised ½(KL(p‖q) + KL(q‖p)), smoothed by 1e-12), `wasserstein` (W1
  between the distributions on the class-index line), `tv` (½ Σ|p − q|), `cosine` (1 − cos).
- `complementarity(d, classes)`: Comp(d_i, d_j) = Σ_{c ∈ classes} d_i(c)(1 − d_j(c)) (CAPT Eq. 6, classes = H ∪ T).
- `cluster_rows(m, k, method, seed)`: each client is the row of its matrix (its distances / complementarities to
  every participant) and the rows are clustered: `kmeans` (CAPT), `agglomerative`, `gmm`, `spectral`. CAPT's
  heterogeneity clustering as printed (Eq. 6 + "apply K-means clustering") is `cluster_rows` on the rows of C.
- `complementary_clusters(c, k, ...)` (CAPT's `het_grouping: deal`, not the paper's default): CAPT says it wants
  heterogeneity clusters that *mix* head-heavy and tail-heavy clients, but K-means on the rows of C puts clients
  with the same complementarity profile together. So the clusterer first finds k profile groups on the rows of C;
  the k heterogeneity clusters are then dealt from them: the members of each profile group (largest group first)
  go one by one to the smallest cluster, ties broken by the highest mean symmetric complementarity with the
  cluster's members, then by cluster index. Every cluster so receives clients of different profiles (promptfcl's
  reading of the stated aim; the paper gives no details).
"""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np

Metric = Literal["js", "kl", "wasserstein", "tv", "cosine"]
Clusterer = Literal["kmeans", "agglomerative", "gmm", "spectral"]
_EPS = 1e-12


def normalise(counts: np.ndarray) -> np.ndarray:
    """Rows of label counts → label distributions (all-zero rows stay zero)."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, total, out=np.zeros_like(counts), where=total > 0)


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(p_i ‖ q_j) for all pairs, (n, n), with 0·log 0 = 0."""
    p3, q3 = p[:, None, :], q[None, :, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p3 > 0, p3 * (np.log(np.maximum(p3, _EPS)) - np.log(np.maximum(q3, _EPS))), 0.0)
    return terms.sum(axis=2)


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """JS(p ‖ q) = ½ KL(p ‖ m) + ½ KL(q ‖ m), m = (p + q)/2 (CAPT Eq. 5)."""
    m = (p + q) / 2
    return float(0.5 * _kl(p[None], m[None])[0, 0] + 0.5 * _kl(q[None], m[None])[0, 0])


def pairwise_distance(d: np.ndarray, metric: Metric = "js") -> np.ndarray:
    """(n, n) distances between the rows of d (label distributions)."""
    d = np.asarray(d, dtype=np.float64)
    n = len(d)
    if metric == "js":
        out = np.array([[js_divergence(d[i], d[j]) for j in range(n)] for i in range(n)])
    elif metric == "kl":
        k = _kl(d, d)
        out = 0.5 * (k + k.T)
    elif metric == "wasserstein":
        cdf = np.cumsum(d, axis=1)
        out = np.abs(cdf[:, None, :] - cdf[None, :, :]).sum(axis=2)
    elif metric == "tv":
        out = 0.5 * np.abs(d[:, None, :] - d[None, :, :]).sum(axis=2)
    elif metric == "cosine":
        norm = np.linalg.norm(d, axis=1, keepdims=True)
        u = np.divide(d, norm, out=np.zeros_like(d), where=norm > 0)
        out = 1.0 - u @ u.T
    else:
        raise ValueError(f"unknown distance {metric!r}; use js, kl, wasserstein, tv or cosine")
    np.fill_diagonal(out, 0.0)
    return np.maximum(out, 0.0)


def complementarity(d: np.ndarray, classes: np.ndarray | list[int] | None = None) -> np.ndarray:
    """C[i, j] = Σ_{c ∈ classes} d_i(c)(1 − d_j(c)) (CAPT Eq. 6); all classes when `classes` is None."""
    d = np.asarray(d, dtype=np.float64)
    if classes is not None:
        d = d[:, np.asarray(classes, dtype=np.int64)]
    return d.sum(axis=1, keepdims=True) - d @ d.T


def cluster_rows(m: np.ndarray, k: int, method: Clusterer = "kmeans", seed: int = 0) -> np.ndarray:
    """Cluster labels (n,) of the rows of m into at most k clusters, relabelled by first appearance."""
    m = np.asarray(m, dtype=np.float64)
    n = len(m)
    k = max(1, min(k, n))
    distinct = len(np.unique(m.round(12), axis=0))
    if k == 1 or distinct == 1:
        return np.zeros(n, dtype=np.int64)
    k = min(k, distinct)
    rs = seed % (2**31)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "kmeans":
            from sklearn.cluster import KMeans

            labels = KMeans(n_clusters=k, n_init=10, random_state=rs).fit_predict(m)
        elif method == "agglomerative":
            from sklearn.cluster import AgglomerativeClustering

            labels = AgglomerativeClustering(n_clusters=k).fit_predict(m)
        elif method == "gmm":
            from sklearn.mixture import GaussianMixture

            labels = GaussianMixture(n_components=k, random_state=rs, reg_covar=1e-6).fit_predict(m)
        elif method == "spectral":
            from sklearn.cluster import SpectralClustering

            labels = SpectralClustering(n_clusters=k, random_state=rs, affinity="rbf").fit_predict(m)
        else:
            raise ValueError(f"unknown clusterer {method!r}; use kmeans, agglomerative, gmm or spectral")
    first: dict[int, int] = {}
    return np.array([first.setdefault(int(x), len(first)) for x in labels], dtype=np.int64)


def complementary_clusters(c: np.ndarray, k: int, method: Clusterer = "kmeans", seed: int = 0) -> np.ndarray:
    """k clusters that mix complementarity profiles (see the module docstring); labels (n,)."""
    c = np.asarray(c, dtype=np.float64)
    n = len(c)
    k = max(1, min(k, n))
    profiles = cluster_rows(c, k, method, seed)
    sym = (c + c.T) / 2
    groups = [np.flatnonzero(profiles == g) for g in range(int(profiles.max()) + 1)]
    groups.sort(key=lambda g: (-len(g), int(g[0])))
    labels = np.full(n, -1, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(k)]
    for group in groups:
        for i in group:
            smallest = min(len(m) for m in members)
            best = max(
                (h for h in range(k) if len(members[h]) == smallest),
                key=lambda h: (float(np.mean(sym[i, members[h]])) if members[h] else 0.0, -h),
            )
            members[best].append(int(i))
            labels[i] = best
    return labels


def cluster_gain(dist: np.ndarray, labels: np.ndarray, seed: int = 0, draws: int = 200) -> float | None:
    """How much closer the clients within a cluster are than within random groups of the same sizes:
    1 − mean within-cluster distance / its mean over `draws` seeded random relabellings (0: no better than chance,
    1: clusters of identical distributions). None when no cluster holds two clients."""
    dist = np.asarray(dist, dtype=np.float64)

    def within(lab: np.ndarray) -> float | None:
        same = (lab[:, None] == lab[None, :]) & ~np.eye(len(lab), dtype=bool)
        return float(dist[same].mean()) if same.any() else None

    observed = within(np.asarray(labels))
    if observed is None:
        return None
    rng = np.random.default_rng(seed % 2**32)
    chance = [w for _ in range(draws) if (w := within(rng.permutation(labels))) is not None]
    base = float(np.mean(chance)) if chance else 0.0
    return 1.0 - observed / base if base > 0 else 0.0
