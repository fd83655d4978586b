"""Writes a run's result files: metrics.json, accuracy_matrix.csv, rounds.jsonl, PNG plots, report.md."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from promptfcl.checkpoint import atomic_write_text
from promptfcl.report.plots import plot_accuracy_curves, plot_accuracy_matrix, plot_slot_accuracy


def clean_json(x: Any) -> Any:
    """NaN/inf → None so results stay valid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean_json(v) for v in x]
    return x


def write_rounds(run_dir: Path, rounds: list[dict]) -> None:
    atomic_write_text(run_dir / "rounds.jsonl", "".join(json.dumps(clean_json(r)) + "\n" for r in rounds))


def accuracy_matrix_csv(A: list[list[float]]) -> str:
    T = len(A)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["after_task"] + [f"task_{i}" for i in range(T)])
    for t, row in enumerate(A):
        w.writerow([t] + [f"{v:.4f}" for v in row[: t + 1]] + [""] * (T - t - 1))
    return buf.getvalue()


def slot_matrix_csv(M: list[list[float | None]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["after_stage"] + [f"label_task_{g}" for g in range(len(M[0]) if M else 0)])
    for s, row in enumerate(M):
        w.writerow([s] + ["" if v is None else f"{v:.4f}" for v in row])
    return buf.getvalue()


def write_final(run_dir: Path, name: str, metrics: dict[str, Any]) -> None:
    A = metrics["accuracy_matrix"]
    atomic_write_text(run_dir / "metrics.json", json.dumps(clean_json(metrics), indent=2))
    if metrics.get("regime") == "task_aware_slots":  # stage × (client, task) slot groups
        atomic_write_text(run_dir / "accuracy_matrix.csv", slot_matrix_csv(A))
        plot_slot_accuracy(A, run_dir / "accuracy_matrix.png", f"{name}: task-aware accuracy (%)")
    else:
        atomic_write_text(run_dir / "accuracy_matrix.csv", accuracy_matrix_csv(A))
        plot_accuracy_matrix(A, run_dir / "accuracy_matrix.png", f"{name}: accuracy (%)")
    plot_accuracy_curves({name: metrics["accuracy_curve"]}, run_dir / "accuracy_curve.png")
    atomic_write_text(run_dir / "report.md", markdown_report(name, metrics))


SUMMARY_ROWS = [  # regime-specific summary keys, shown before the standard rows when a run has them
    ("acc", "Acc (%, mean over stage ends)"),  # task-aware per-(client, task) transfer metrics
    ("aia", "AIA (%, time-averaged)"),
    ("fwt", "FWT (%)"),
    ("total_transfer", "total transfer (%)"),
    ("kr_t", "KR_t (%)"),  # client_local knowledge retention
    ("kr_s", "KR_s (%)"),
]


SCORED_MODEL = {  # metrics.json `scored_model` of task-aware per-(client, task) runs (evaluation.regimes)
    "global": "the global model",
    "client": "each client's own aggregated model",
    "task": "each (client, task)'s own model",
    "clients": "each client's own model (mean over clients)",
}


def scored_model_label(metrics: dict[str, Any]) -> str | None:
    """What a task-aware per-(client, task) run or a local-only control scored, in words (None otherwise)."""
    kind = metrics.get("scored_model")
    return SCORED_MODEL.get(kind, str(kind)) if kind else None


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) and math.isfinite(v) else "n/a"


def summary_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    s, comm, t = metrics["summary"], metrics["communication"], metrics["timing"]
    groups = [(f"{g} accuracy (%)", f"{v:.2f}") for g, v in s.get("class_groups", {}).items()]
    extra = [(label, _fmt(s.get(key))) for key, label in SUMMARY_ROWS if key in s]
    bound = [("upper bound", str(metrics["upper_bound"]))] if metrics.get("upper_bound") else []
    scored = scored_model_label(metrics)
    per = "" if metrics.get("scored_model") == "clients" else ", per (client, task)"
    bound += [("scored on", f"{scored}{per}")] if scored else []
    domains = metrics.get("client_domains")  # per-client image domains (scenario.domains), in client order
    bound += [("client image domains", " / ".join(domains))] if domains else []
    return (
        bound
        + groups
        + extra
        + [
            ("FAA (%)", f"{s['faa']:.2f}"),
            ("sample-weighted accuracy (%)", f"{s['sample_weighted_accuracy']:.2f}"),
            ("average forgetting (%)", f"{s['average_forgetting']:.2f}"),
            ("BWT (%)", f"{s['bwt']:.2f}"),
            ("MB per round (up + down)", f"{comm['mb_per_round']:.3f}"),
            ("wall time (s)", f"{t['total_seconds']:.1f}"),
        ]
    )


def markdown_report(name: str, metrics: dict[str, Any]) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary_rows(metrics))
    curve = " → ".join("n/a" if v is None else f"{v:.1f}" for v in metrics["accuracy_curve"])
    timing = metrics["timing"]
    return (
        f"# {name}\n\n| metric | value |\n| --- | --- |\n{rows}\n\n"
        f"Average accuracy after each task: {curve}\n\n"
        f"Time: setup {timing['setup_seconds']:.1f} s, client training {timing['client_seconds']:.1f} s, "
        f"server {timing['server_seconds']:.1f} s, evaluation {timing['eval_seconds']:.1f} s.\n\n"
        "![accuracy matrix](accuracy_matrix.png)\n![accuracy curve](accuracy_curve.png)\n"
        "![client x class counts](scenario_heatmap.png)\n\nFiles: `config.yaml` (resolved config), "
        "`scenario.json`, `metrics.json`, `accuracy_matrix.csv`, `rounds.jsonl`.\n"
    )
