"""PNG plots of a run: accuracy matrix, accuracy after each task, client × class sample counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_accuracy_matrix(A: Sequence[Sequence[float]], path: Path, title: str = "") -> None:
    T = len(A)
    M = np.full((T, T), np.nan)
    for t, row in enumerate(A):
        M[t, : len(row)] = row[: t + 1]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 + 0.55 * T), max(3.8, 1.2 + 0.5 * T)))
    im = ax.imshow(M, vmin=0, vmax=100, cmap="viridis")
    for t in range(T):
        for i in range(t + 1):
            ax.text(
                i, t, f"{M[t, i]:.0f}", ha="center", va="center", fontsize=7, color="white" if M[t, i] < 60 else "black"
            )
    ax.set_xlabel("evaluated task")
    ax.set_ylabel("after training task")
    ax.set_xticks(range(T))
    ax.set_yticks(range(T))
    ax.set_title(title or "accuracy (%)")
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accuracy_curves(curves: Mapping[str, Sequence[float]], path: Path, title: str = "") -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, marker="o", label=name)
    ax.set_xlabel("tasks learned")
    ax.set_ylabel("average accuracy over seen tasks (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "accuracy after each task")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_client_class_counts(counts: np.ndarray, path: Path, task_sizes: Sequence[int] = ()) -> None:
    clients, classes = counts.shape
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.5, 2 + 0.12 * classes)), max(3.0, 1.5 + 0.3 * clients)))
    im = ax.imshow(counts, aspect="auto", cmap="magma_r", interpolation="nearest")
    pos = 0
    for n in list(task_sizes)[:-1]:
        pos += n
        ax.axvline(pos - 0.5, color="tab:cyan", lw=1.5)
    ax.set_xlabel("class position in class order (cyan lines: task boundaries)")
    ax.set_ylabel("client")
    ax.set_yticks(range(clients))
    ax.set_title("training samples per client and class")
    fig.colorbar(im, ax=ax, label="samples")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_client_tasks(matrix: np.ndarray, path: Path) -> None:
    """Personalized scenarios: in which task each client learns each class (blank: never)."""
    clients, classes = matrix.shape
    T = int(matrix.max())
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.5, 2 + 0.12 * classes)), max(3.0, 1.5 + 0.3 * clients)))
    shown = np.ma.masked_equal(matrix, 0)
    im = ax.imshow(shown, aspect="auto", cmap=plt.get_cmap("tab10", max(T, 1)), vmin=0.5, vmax=T + 0.5,
                   interpolation="nearest")  # fmt: skip
    ax.set_xlabel("class position in class order")
    ax.set_ylabel("client")
    ax.set_yticks(range(clients))
    ax.set_title("task in which each client learns each class (blank: class not held)")
    fig.colorbar(im, ax=ax, label="task (1-based)", ticks=range(1, T + 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
