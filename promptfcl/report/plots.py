"""PNG plots of a run: accuracy matrix, accuracy after each task, client × class sample counts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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


def _styles(n: int) -> list[tuple[Any, str]]:
    colors = plt.get_cmap("tab10" if n <= 10 else "tab20").colors
    markers = "osD^vP*Xh<>p"
    return [(colors[i % len(colors)], markers[i % len(markers)]) for i in range(n)]


def plot_mean_accuracy_curves(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: Path) -> None:
    """Average accuracy over seen tasks after each task, one line per method (mean, band: ± std over seeds)."""
    n = len(curves)
    fig, ax = plt.subplots(figsize=(8.5 if n > 6 else 6.5, 4.5))
    for (name, (mean, std)), (color, marker) in zip(curves.items(), _styles(n), strict=True):
        x = np.arange(1, len(mean) + 1)
        m, s = np.asarray(mean, float), np.asarray(std, float)
        ax.plot(x, m, marker=marker, color=color, label=name, ms=4)
        if s.any():
            ax.fill_between(x, m - s, m + s, color=color, alpha=0.15, lw=0)
    longest = max((len(m) for m, _ in curves.values()), default=1)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("tasks learned")
    ax.set_ylabel("average accuracy over seen tasks (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title("accuracy after each task (mean over seeds, band ± std)")
    _legend_and_save(fig, ax, n, path)


def plot_accuracy_matrices(matrices: Mapping[str, Sequence[Sequence[float]]], path: Path) -> None:
    """One accuracy-matrix heatmap per method on a shared 0-100 % colour scale (mean over seeds)."""
    n = len(matrices)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    T = max(len(A) for A in matrices.values())
    size = max(2.8, 0.32 * T + 1.2)
    fig, axes = plt.subplots(
        rows, cols, figsize=(size * cols + 1.2, size * rows + 0.6), squeeze=False, layout="constrained"
    )
    im = None
    for ax, (name, A) in zip(axes.flat, matrices.items(), strict=False):
        t_n = len(A)
        M = np.full((t_n, t_n), np.nan)
        for t, row in enumerate(A):
            M[t, : t + 1] = row[: t + 1]
        im = ax.imshow(M, vmin=0, vmax=100, cmap="viridis")
        if t_n <= 10:
            for t in range(t_n):
                for i in range(t + 1):
                    color = "white" if M[t, i] < 60 else "black"
                    ax.text(i, t, f"{M[t, i]:.0f}", ha="center", va="center", fontsize=7, color=color)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("evaluated task", fontsize=8)
        ax.set_ylabel("after training task", fontsize=8)
        ax.set_xticks(range(t_n), [str(k + 1) for k in range(t_n)])
        ax.set_yticks(range(t_n), [str(k + 1) for k in range(t_n)])
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes, label="accuracy (%)", shrink=0.8, aspect=30)
    fig.suptitle("accuracy on each task after each training task (mean over seeds)", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_accuracy_vs_communication(
    points: Mapping[str, tuple[float, float, float, float]], path: Path, log_x: bool | None = None
) -> None:
    """Final average accuracy vs total traffic per run, one point per method: (MB, MB std, FAA, FAA std)."""
    n = len(points)
    fig, ax = plt.subplots(figsize=(8.5 if n > 6 else 6.5, 4.5))
    xs = [p[0] for p in points.values()]
    positive = [x for x in xs if x > 0]
    if log_x is None:
        log_x = bool(positive) and max(xs) / min(positive) > 20
    for (name, (x, xe, y, ye)), (color, marker) in zip(points.items(), _styles(n), strict=True):
        ax.errorbar(x, y, xerr=xe or None, yerr=ye or None, fmt=marker, color=color, label=name, ms=6, capsize=3)
        if n <= 6:  # beyond that the legend outside the axes names the points; labels would collide
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7, color=color)
    ax.margins(x=0.15, y=0.12)
    if log_x and len(positive) < len(xs):  # runs without traffic (zero-shot) stay on the axis: linear below it
        ax.set_xscale("symlog", linthresh=min(positive))
    elif log_x:
        ax.set_xscale("log")
    else:
        ax.set_xlim(left=-0.03 * max(max(xs), 1e-9))  # points at 0 MB (zero-shot) stay visible
    ax.set_xlabel("total communication per run, up + down (MB" + (", log scale)" if log_x else ")"))
    ax.set_ylabel("final average accuracy, FAA (%)")
    ax.grid(alpha=0.3, which="both")
    ax.set_title("accuracy vs communication (mean ± std over seeds)")
    _legend_and_save(fig, ax, n, path)


def plot_task_timeline(schedule: Sequence[Sequence[int]], owners: Sequence[Sequence[int]] | None, path: Path) -> None:
    """Client × stage grid of the task each client trains (asynchronous scenarios); a switch is marked by *."""
    stages, clients = len(schedule), len(schedule[0])
    task = np.array([[owners[g][1] if owners else g for g in row] for row in schedule]).T  # (clients, stages)
    fig, ax = plt.subplots(figsize=(max(5.5, 1.5 + 0.7 * stages), max(2.8, 1.2 + 0.45 * clients)))
    im = ax.imshow(task, aspect="auto", cmap="tab10", vmin=-0.5, vmax=9.5, interpolation="nearest")
    for k in range(clients):
        for s in range(stages):
            new = s > 0 and schedule[s][k] != schedule[s - 1][k]
            ax.text(s, k, f"{task[k, s]}{'*' if new else ''}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("stage")
    ax.set_ylabel("client")
    ax.set_xticks(range(stages))
    ax.set_yticks(range(clients))
    ax.set_title("task index per client and stage (* = switch)")
    fig.colorbar(im, ax=ax, label="task index")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_slot_accuracy(matrix: Sequence[Sequence[float | None]], path: Path, title: str = "") -> None:
    """Stage × label-space task accuracy of a task-aware per-(client, task) run (blank: not trained yet)."""
    M = np.array([[np.nan if v is None else v for v in row] for row in matrix], dtype=float)
    fig, ax = plt.subplots(figsize=(min(16.0, max(5.0, 1.5 + 0.35 * M.shape[1])), max(3.0, 1.2 + 0.5 * M.shape[0])))
    im = ax.imshow(M, vmin=0, vmax=100, cmap="viridis", aspect="auto", interpolation="nearest")
    ax.set_xlabel("label-space task (client, task) slot group")
    ax.set_ylabel("after stage")
    ax.set_yticks(range(M.shape[0]))
    ax.set_title(title or "task-aware accuracy (%)")
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _legend_and_save(fig: plt.Figure, ax: plt.Axes, entries: int, path: Path) -> None:
    """Legend inside the axes for a few entries, outside on the right for many; then write the PNG."""
    if entries > 6:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
