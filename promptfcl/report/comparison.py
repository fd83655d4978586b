"""The comparison report of several runs or a study: `report.md` plus a self-contained `report.html`.

Contents: the comparison table (mean ± std over seeds of FAA/A_N, forgetting, BWT, any other numeric summary
key the runs report, MB per round, wall time), each row's set-up (data, scenario, backbone: a random-init
backbone is flagged), accuracy-after-each-task curves of every row in one plot, accuracy-matrix heatmaps, an
accuracy-vs-communication scatter, the client × class heatmap of each distinct scenario, and the exact config
and environment (package versions, git commit) of every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from promptfcl.checkpoint import atomic_write_text
from promptfcl.config import client_domain_steps
from promptfcl.report.collect import (
    Group,
    RunResult,
    aggregate,
    format_value,
    mean_std,
    row_label,
    validity_label,
)
from promptfcl.report.document import Block, Code, Details, Heading, Image, Table, Text, to_html, to_markdown
from promptfcl.report.plots import plot_accuracy_matrices, plot_accuracy_vs_communication, plot_mean_accuracy_curves
from promptfcl.report.results import scored_model_label

COLUMN_NOTES = (
    "FAA: average accuracy over all tasks after the last one (HGP's FAA, HePCo's A_N); forgetting: mean drop "
    "from each old task's best accuracy (Chaudhry et al.); BWT: mean change of each old task's accuracy since it "
    "was learned; MB / round: bytes up + down per round; wall time: one run, end to end (runs that shared the "
    "CPU are slower). Other columns are the runs' own summary keys. Values are mean ± std over seeds."
)


UPPER_BOUND_NOTE = (
    "**Upper bounds** (rows marked `[upper bound: …]`) are not federated methods: the same prompted model, data, "
    "backbone, budget and evaluation, trained by one learner. *centralized*: task by task, holding every client's "
    "data of each task (HePCo's \"Prompting (centralized)\"); *joint*: all classes at once as one task (HGP's "
    '"Joint"), whose FAA is its accuracy over all classes (compare with the federated rows\' FAA / A_N; its '
    "forgetting and BWT are 0 by definition). Their MB / round is the one learner's model exchange, not federation "
    "traffic, so they are left out of the accuracy-vs-communication plot."
)


def backbone_label(cfg: dict[str, Any]) -> str:
    b = cfg.get("backbone", {})
    clip = b.get("kind") == "clip"
    hub = f"pretrained (hub{', tag ' + str(b.get('tag')) if clip else ''})"
    where = (
        f"weights {Path(b['weights']).name}"
        if b.get("weights")
        else (hub if b.get("pretrained") else "**RANDOM INIT (no pretrained weights)**")
    )
    e = cfg.get("engine", {})
    precision = e.get("precision", "fp32")
    run = f", {precision}" if precision != "fp32" else ""
    run += ", compiled" if e.get("compile") else ""
    return f"{'CLIP ' if clip else ''}{b.get('name', '?')} @ {b.get('img_size', '?')} px, {where}{run}"


SLICE_NOTES = {"distinct": ", a new slice per class repeat", "disjoint": ", no image shared by two clients"}


def domains_label(domains: dict[str, Any] | None, num_clients: int) -> str:
    """', per-client image domains: colour / blur / …' (client order) for `scenario.domains`, else ''."""
    if not domains or not domains.get("clients"):
        return ""
    steps = client_domain_steps(domains["clients"], num_clients)
    return ", per-client image domains: " + " / ".join("+".join(s) or "none" for s in steps)


def scenario_label(cfg: dict[str, Any]) -> str:
    s, d = cfg.get("scenario", {}), cfg.get("data", {})
    p = s.get("partition", {})
    kind = p.get("kind", "?")
    if kind == "dirichlet":
        part = f"Dirichlet β={p.get('beta')}"
    elif kind == "hepco":
        part = f"HePCo κ={p.get('category_ratio')} γ={p.get('split_ratio')} β={p.get('imbalance')}"
    else:
        part = kind
    if s.get("kind") == "long_tailed":
        part = f"long-tailed IF={(s.get('long_tail') or {}).get('imbalance_factor')}, {part}"
    elif s.get("kind") == "asynchronous":  # Powder / C2Prompt: own task sequences, no Dirichlet split
        a = s.get("asynchronous") or {}
        switching = a.get("switching_clients")
        part = (
            f"asynchronous task switching ({'⌊K/2⌋' if switching is None else switching} clients per stage, "
            f"overlap ≥ {a.get('min_overlap')}, 1/{a.get('data_slices')} data slices"
            f"{SLICE_NOTES.get(a.get('slice_rule'), '')})"
        )
        part += domains_label(s.get("domains"), s.get("num_clients") or 0)
    elif s.get("kind") == "personalized":  # FedMGP: per-client task sequences
        q = s.get("personalized") or {}
        classes = (
            f"{q.get('private_classes')} private + {q.get('public_classes')} public classes"
            if q.get("mode") == "asynchronous"
            else "shared class order"
        )
        part = f"personalized {q.get('mode')} ({classes}, Dirichlet β={q.get('beta')})"
    per_class = f", {d.get('train_per_class')}/{d.get('test_per_class')} train/test per class"
    sub = per_class if d.get("train_per_class") or d.get("test_per_class") else ""
    tasks, clients = f"{s.get('num_tasks')} tasks", f"{s.get('num_clients')} clients"
    if s.get("upper_bound") == "joint":
        tasks = f"UPPER BOUND (joint): one task of the classes of {tasks}"
    elif s.get("upper_bound"):
        tasks = f"{tasks}, UPPER BOUND ({s['upper_bound']})"
    if s.get("upper_bound"):
        clients = f"one learner holding the data of {clients}"
    return f"{d.get('name', '?')}{sub}; {tasks}, {clients}, {part}, {s.get('rounds_per_task')} rounds/task"


SCORED_NOTE = (
    "**Scored models differ.** Task-aware rows score each (client, task) with the model the server holds for that "
    "client: methods that send every client its own aggregate (C2Prompt's CPA) are scored on each client's own "
    "model, FedAvg-style methods on the one global model. Here: "
)


def setup_label(run: RunResult) -> str:
    """The set-up table's scenario cell: the scenario, and for task-aware per-(client, task) runs the model scored."""
    scored = scored_model_label(run.metrics)
    label = scenario_label(run.config)
    return f"{label}; scored per (client, task) on {scored}" if scored else label


def _commit(run: RunResult) -> str:
    git = run.environment.get("git") or {}
    if not git.get("commit"):
        return "unknown (not recorded)"
    return git["commit"][:12] + (" (uncommitted changes)" if git.get("dirty") else "")


def _scenario_key(run: RunResult) -> str:
    """Runs with the same scenario.json (class order, tasks, every client's indices) share one heatmap."""
    path = run.run_dir / "scenario.json"
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return json.dumps([run.config.get("data"), run.config.get("scenario"), run.seed], sort_keys=True)


def _rel(path: Path, root: Path) -> str:
    try:
        return os.path.relpath(path, root)
    except ValueError:
        return str(path)


def build_blocks(groups: list[Group], out: Path, title: str, intro: str) -> list[Block]:
    """Write the figures under `out/figures/` and return the report's blocks."""
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    done = [g for g in groups if g.runs]
    rows, columns = aggregate(groups)
    sweep_keys = sorted({k for g in groups for k in g.sweep})
    header = ["cell", "method", "seeds", "valid", *sweep_keys, *columns]
    table = [
        [row_label(r), r["method"], str(r["seeds"]), validity_label(r)]
        + [json.dumps(r["sweep"].get(k, "")) for k in sweep_keys]
        + [format_value(r["values"][c], r["seeds"]) for c in columns]
        for r in rows
    ]
    blocks: list[Block] = [
        Heading(title, 1),
        Text(intro),
        Heading("Comparison"),
        Table(header, table),
        Text(COLUMN_NOTES),
    ]
    bounds = [g for g in done if g.upper_bound]
    if bounds:
        blocks.append(
            Text(UPPER_BOUND_NOTE + " Here: " + ", ".join(f"`{g.name}` ({g.upper_bound})" for g in bounds) + ".")
        )
    random_init = [g.name for g in done if "RANDOM INIT" in backbone_label(g.runs[0].config)]
    if random_init:
        blocks.append(
            Text(
                "**Random-init backbone** in " + ", ".join(f"`{n}`" for n in random_init) + ": no pretrained "
                "weights were found, so these accuracies test the mechanics only, not the methods."
            )
        )
    blocks += validity_blocks(done)
    blocks += [
        Heading("Set-up", 3),
        Table(
            ["cell", "scenario", "backbone"],
            [[g.name, setup_label(g.runs[0]), backbone_label(g.runs[0].config)] for g in done],
        ),
    ]
    scored = {g.name: scored_model_label(g.runs[0].metrics) for g in done}
    if len({v for v in scored.values() if v}) > 1:
        blocks.append(Text(SCORED_NOTE + "; ".join(f"`{n}`: {v}" for n, v in scored.items() if v) + "."))
    if done:
        blocks += [Heading("Figures")] + _figures(done, fig_dir)
    blocks += [Heading("Runs: exact config and environment"), *_run_details(done, out)]
    return blocks


VALIDITY_NOTE = (
    "Validity gate (`promptfcl/evaluation/validity.py`): each value is the mean over seeds of the check's value. "
    "client_loss = worst task's final-epoch client loss / ln K (≤ 0.5); learned_tasks = worst task's binomial p that "
    "its accuracy right after learning is at chance (< 0.001); prompt_effect = % of test predictions that change "
    "when every prompt is removed (≥ 5); method signals as documented there. A cell with a failing seed is marked "
    "⚠ INVALID and cannot support a claim."
)


def validity_blocks(groups: list[Group]) -> list[Block]:
    """The evidence table: per cell, the mean over seeds of every validity check's value, failing seeds named."""
    names: list[str] = []
    for g in groups:
        for r in g.runs:
            for c in (r.metrics.get("validity") or {}).get("checks", []):
                if c["name"] not in names and c["name"] != "backbone_pretrained":
                    names.append(c["name"])
    if not names:
        return []
    table = []
    for g in groups:
        cells = []
        for name in names:
            vals = [
                c["value"]
                for r in g.runs
                for c in (r.metrics.get("validity") or {}).get("checks", [])
                if c["name"] == name and c["value"] is not None
            ]
            cells.append(f"{sum(vals) / len(vals):.3g}" if vals else "–")
        failing = [f"seed {r.seed}: {', '.join(r.failed_checks)}" for r in g.runs if r.failed_checks]
        table.append([g.name, *cells, "; ".join(failing) or "all pass"])
    return [Heading("Validity", 3), Text(VALIDITY_NOTE), Table(["cell", *names, "failing"], table)]


def _figures(groups: list[Group], fig_dir: Path) -> list[Block]:
    """Curves, heatmaps and the scatter of the groups that have what each plot needs (ragged seeds skipped)."""
    blocks: list[Block] = []
    curves = {}
    for g in groups:
        cs = [r.metrics.get("accuracy_curve") for r in g.runs]
        if all(cs) and len({len(c) for c in cs}) == 1 and len(cs[0]) > 1:  # one task: nothing to plot over
            a = np.array(cs, dtype=float)
            curves[g.name] = (a.mean(0).tolist(), a.std(0, ddof=1).tolist() if len(a) > 1 else [0.0] * a.shape[1])
    if curves:
        plot_mean_accuracy_curves(curves, fig_dir / "accuracy_curves.png")
        blocks.append(Image(fig_dir / "accuracy_curves.png", "accuracy after each task"))
    matrices = {}
    for g in groups:
        mats = [r.metrics.get("accuracy_matrix") for r in g.runs]
        if all(mats) and len({len(m) for m in mats}) == 1 and len(mats[0]) > 1:
            T = len(mats[0])
            matrices[g.name] = [[float(np.mean([m[t][i] for m in mats])) for i in range(t + 1)] for t in range(T)]
    if matrices:
        plot_accuracy_matrices(matrices, fig_dir / "accuracy_matrices.png")
        blocks.append(Image(fig_dir / "accuracy_matrices.png", "accuracy matrices"))
    single = [g.name for g in groups if g.name not in matrices]
    if single:
        blocks.append(Text("No curve or accuracy matrix for " + ", ".join(f"`{n}`" for n in single) + " (one task)."))
    points = {}
    for g in groups:
        if g.upper_bound:  # no federation traffic to plot against
            continue
        faas = [r.column_values().get("FAA (%)") for r in g.runs]
        if all(f is not None for f in faas):
            mb = mean_std([r.total_mb for r in g.runs])
            faa = mean_std([float(f) for f in faas])  # type: ignore[arg-type]
            points[g.name] = (mb[0], mb[1], faa[0], faa[1])
    if points:
        plot_accuracy_vs_communication(points, fig_dir / "accuracy_vs_communication.png")
        blocks.append(Image(fig_dir / "accuracy_vs_communication.png", "accuracy vs communication"))
    blocks.append(Heading("Scenarios: training samples per client and class", 3))
    families: dict[str, list[Group]] = {}
    for g in groups:
        families.setdefault(_scenario_key(g.runs[0]), []).append(g)
    for k, members in enumerate(families.values()):
        first = members[0].runs[0]
        src = first.run_dir / "scenario_heatmap.png"
        if not src.is_file():
            continue
        dst = fig_dir / f"scenario_{k}.png"
        shutil.copyfile(src, dst)
        names = ", ".join(f"`{g.name}`" for g in members)
        blocks += [
            Text(
                f"Scenario {k + 1} ({scenario_label(first.config)}), used by {names}; shown for seed {first.seed} "
                "(each seed draws its own class order where shuffled, and its own partition)."
            ),
            Image(dst, f"client x class counts, scenario {k + 1}"),
        ]
        timeline = first.run_dir / "scenario_timeline.png"  # asynchronous scenarios: which task each client learns
        if timeline.is_file():
            shutil.copyfile(timeline, fig_dir / f"scenario_{k}_timeline.png")
            blocks.append(Image(fig_dir / f"scenario_{k}_timeline.png", f"client x stage task ids, scenario {k + 1}"))
    return blocks


def _run_details(groups: list[Group], out: Path) -> list[Block]:
    blocks: list[Block] = []
    for g in groups:
        for r in g.runs:
            env = r.environment
            pkgs = env.get("packages") or {k: env[k] for k in ("torch", "timm", "numpy") if k in env}
            summary = f"{g.name} seed {r.seed}: {_rel(r.run_dir, out)} · git {_commit(r)} · " + ", ".join(
                f"{k} {v}" for k, v in pkgs.items()
            )
            blocks.append(
                Details(
                    summary,
                    [Code(r.config_text or "(no config.yaml)", "yaml"), Code(json.dumps(env, indent=2), "json")],
                )
            )
    return blocks


def write_report(groups: list[Group], out: Path, title: str, intro: str = "") -> Path:
    """Write `out/report.md`, `out/report.html` and `out/figures/*.png`; returns the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    n_runs = sum(len(g.runs) for g in groups)
    intro = (intro + " " if intro else "") + f"{len(groups)} rows, {n_runs} finished runs; generated {stamp}."
    blocks = build_blocks(groups, out, title, intro)
    atomic_write_text(out / "report.md", to_markdown(blocks, out))
    atomic_write_text(out / "report.html", to_html(blocks, title))
    return out / "report.md"
