"""The comparison report of several runs or a study: `report.md`, a self-contained `report.html` and the appendix
`report_configs.md` (every run's exact config and environment, linked from both).

The cells are split by scenario family (`report.families`: runs that saw the same data and scenario, seeds aside;
a personalized cell never shares a table or a plot with a class-incremental one). Each family gets its own
section: the comparison table (mean ± std over seeds of the columns its runs report, under readable headers with
units from `report.labels`, their definitions under it), the validity table (each check's mean per cell), each
row's set-up (data, scenario, backbone: a random-init backbone is flagged), accuracy-after-each-task curves,
accuracy-matrix heatmaps, an accuracy-vs-communication scatter and the client × class heatmap of each distinct
scenario. Cells without a finished run are listed at the end. `summary.{md,csv,json}` (`promptfcl.study`) keep
one table with the raw column names.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections import Counter
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
from promptfcl.report.document import (
    Block,
    Bullets,
    Code,
    Details,
    Heading,
    Image,
    Table,
    Text,
    to_html,
    to_markdown,
)
from promptfcl.report.families import Family, group_families
from promptfcl.report.labels import LABELS, column_headers, column_notes
from promptfcl.report.plots import plot_accuracy_matrices, plot_accuracy_vs_communication, plot_mean_accuracy_curves
from promptfcl.report.results import scored_model_label

APPENDIX = "report_configs.md"  # every run's exact config and environment, next to report.md
COMMITS_SHOWN = 4  # the report names the commits most runs ran at; the appendix has every run's
TABLE_NOTE = (
    "Values are mean ± std over seeds (the mean alone for one seed); `–`: no run of the cell reports the column; "
    f"valid seeds: {LABELS['valid_seeds'].note}. Columns named by a raw key are the runs' own summary keys."
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


def _sweep_value(sweep: dict[str, Any], key: str) -> str:
    return json.dumps(sweep[key]) if key in sweep else "–"


def _comparison_table(groups: list[Group], defined: set[str]) -> list[Block]:
    """The family's table: only the columns its runs report, readable headers, and under it the definitions of
    those not `defined` by an earlier table of the report (`defined` is updated; the value note comes once)."""
    rows, columns = aggregate(groups)
    sweep_keys = sorted({k for g in groups for k in g.sweep})
    header = ["cell", "method", LABELS["seeds"].header, LABELS["valid_seeds"].header, *sweep_keys]
    table = [
        [row_label(r), r["method"], str(r["seeds"]), validity_label(r)]
        + [_sweep_value(r["sweep"], k) for k in sweep_keys]
        + [format_value(r["values"][c], r["seeds"]) for c in columns]
        for r in rows
    ]
    notes = column_notes(columns, defined)
    first = TABLE_NOTE not in defined
    defined.add(TABLE_NOTE)
    text = (f"**Columns.** {notes} " if notes else "") + (TABLE_NOTE if first else "")
    return [Table(header + column_headers(columns), table), *([Text(text.strip())] if text.strip() else [])]


def _family_blocks(family: Family, heading: str, fig_dir: Path, prefix: str, defined: set[str]) -> list[Block]:
    """One family's section: table, notes, validity, set-up and figures (files named `<prefix>…png`); notes that
    an earlier family's section gave (`defined`) are not repeated."""
    done = family.groups
    blocks: list[Block] = [Heading(heading), *_comparison_table(done, defined)]
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
    blocks += validity_blocks(done, note=VALIDITY_NOTE not in defined)
    defined.add(VALIDITY_NOTE)
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
    return blocks + [Heading("Figures", 3), *_figures(done, fig_dir, prefix)]


def build_blocks(groups: list[Group], out: Path, title: str, intro: str) -> list[Block]:
    """Write the figures under `out/figures/` and return the report's blocks: one section per scenario family."""
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    families = group_families(groups)
    blocks: list[Block] = [Heading(title, 1), Text(intro)]
    if len(families) > 1:
        blocks += [
            Text(
                f"**{len(families)} scenario families**, each with its own table and figures (cells whose runs saw "
                "the same data and scenario, seeds and rounds per task aside; numbers of different families are not "
                "comparable):"
            ),
            Bullets([f"{f.label}: " + ", ".join(f"`{g.name}`" for g in f.groups) for f in families]),
        ]
    defined: set[str] = set()  # column definitions and notes already given by an earlier family's section
    for k, family in enumerate(families, 1):
        one = len(families) == 1
        heading = f"Comparison: {family.label}" if one else f"{k}. {family.label}"
        blocks += _family_blocks(family, heading, fig_dir, "" if one else f"family{k}_", defined)
    pending = [g for g in groups if not g.runs]
    if pending:
        sweep_keys = sorted({k for g in pending for k in g.sweep})
        blocks += [
            Heading("Cells without a finished run"),
            Table(
                ["cell", *sweep_keys],
                [[g.name, *(_sweep_value(g.sweep, k) for k in sweep_keys)] for g in pending],
            ),
        ]
    blocks += [Heading("Runs: exact config and environment"), Text(_appendix_note(families))]
    return blocks


def _appendix_note(families: list[Family]) -> str:
    runs = [r for f in families for g in f.groups for r in g.runs]
    commits = Counter(_commit(r) for r in runs).most_common()
    listed = ", ".join(f"`{c}` ({n} run{'s' if n != 1 else ''})" for c, n in commits[:COMMITS_SHOWN])
    if len(commits) > COMMITS_SHOWN:
        listed += f" and {len(commits) - COMMITS_SHOWN} more (each run's in the appendix)"
    return (
        f"Every run's exact `config.yaml` and environment (package versions, git commit) is in [{APPENDIX}]({APPENDIX})"
        f" next to this report. Git commits: {listed or 'none'}."
    )


VALIDITY_NOTE = (
    "Validity gate (`promptfcl/evaluation/validity.py`, which gives every threshold and why): each value is the mean "
    "over seeds of the check's value. A cell with a failing seed is marked ⚠ INVALID and cannot support a claim."
)


def validity_blocks(groups: list[Group], note: bool = True) -> list[Block]:
    """The evidence table: per cell, the mean over seeds of every validity check's value, failing seeds named;
    `note`: explain the checks above it (once per report)."""
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
    explained = [Text(VALIDITY_NOTE)] if note else [Text("Checks as explained in the first validity table.")]
    return [Heading("Validity", 3), *explained, Table(["cell", *names, "failing"], table)]


def _figures(groups: list[Group], fig_dir: Path, prefix: str = "") -> list[Block]:
    """Curves, heatmaps and the scatter of the groups that have what each plot needs (ragged seeds skipped), written
    to `fig_dir/<prefix><plot>.png`."""
    blocks: list[Block] = []
    curves = {}
    for g in groups:
        cs = [r.metrics.get("accuracy_curve") for r in g.runs]
        if all(cs) and len({len(c) for c in cs}) == 1 and len(cs[0]) > 1:  # one task: nothing to plot over
            a = np.array(cs, dtype=float)
            curves[g.name] = (a.mean(0).tolist(), a.std(0, ddof=1).tolist() if len(a) > 1 else [0.0] * a.shape[1])
    if curves:
        plot_mean_accuracy_curves(curves, fig_dir / f"{prefix}accuracy_curves.png")
        blocks.append(Image(fig_dir / f"{prefix}accuracy_curves.png", "accuracy after each task"))
    matrices = {}
    for g in groups:
        mats = [r.metrics.get("accuracy_matrix") for r in g.runs]
        if all(mats) and len({len(m) for m in mats}) == 1 and len(mats[0]) > 1:
            T = len(mats[0])
            matrices[g.name] = [[float(np.mean([m[t][i] for m in mats])) for i in range(t + 1)] for t in range(T)]
    if matrices:
        plot_accuracy_matrices(matrices, fig_dir / f"{prefix}accuracy_matrices.png")
        blocks.append(Image(fig_dir / f"{prefix}accuracy_matrices.png", "accuracy matrices"))
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
        plot_accuracy_vs_communication(points, fig_dir / f"{prefix}accuracy_vs_communication.png")
        blocks.append(Image(fig_dir / f"{prefix}accuracy_vs_communication.png", "accuracy vs communication"))
    blocks.append(Heading("Scenarios: training samples per client and class", 4))
    families: dict[str, list[Group]] = {}
    for g in groups:
        families.setdefault(_scenario_key(g.runs[0]), []).append(g)
    for k, members in enumerate(families.values()):
        first = members[0].runs[0]
        src = first.run_dir / "scenario_heatmap.png"
        if not src.is_file():
            continue
        dst = fig_dir / f"{prefix}scenario_{k}.png"
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
            dst = fig_dir / f"{prefix}scenario_{k}_timeline.png"
            shutil.copyfile(timeline, dst)
            blocks.append(Image(dst, f"client x stage task ids, scenario {k + 1}"))
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


FIGURE = re.compile(
    r"(family\d+_)?(accuracy_curves|accuracy_matrices|accuracy_vs_communication|scenario_\d+(_timeline)?)\.png"
)


def _remove_stale_figures(fig_dir: Path, blocks: list[Block]) -> None:
    """Delete the report's own figure files that this version no longer shows (e.g. the one-table plots of a
    report now split by family), so a regenerated report's folder holds only what it links."""
    used = {Path(b.path).resolve() for b in blocks if isinstance(b, Image)}
    for path in fig_dir.glob("*.png"):
        if FIGURE.fullmatch(path.name) and path.resolve() not in used:
            path.unlink()


def write_appendix(groups: list[Group], out: Path, title: str) -> Path:
    """Write `out/report_configs.md`: every finished run's exact config and environment, by scenario family."""
    blocks: list[Block] = [
        Heading(f"{title}: exact config and environment of every run", 1),
        Text("Appendix of [report.md](report.md) (and report.html): each run's `config.yaml` and `environment.json`."),
    ]
    for family in group_families(groups):
        blocks += [Heading(family.label), *_run_details(family.groups, out)]
    atomic_write_text(out / APPENDIX, to_markdown(blocks, out))
    return out / APPENDIX


def write_report(groups: list[Group], out: Path, title: str, intro: str = "") -> Path:
    """Write `out/report.md`, `out/report.html`, the appendix `out/report_configs.md` and `out/figures/*.png`;
    returns the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    n_runs = sum(len(g.runs) for g in groups)
    n_families = len(group_families(groups))
    families = f" in {n_families} scenario famil{'ies' if n_families != 1 else 'y'}" if n_families > 1 else ""
    intro = (intro + " " if intro else "") + f"{len(groups)} rows, {n_runs} finished runs{families}; generated {stamp}."
    blocks = build_blocks(groups, out, title, intro)
    write_appendix(groups, out, title)
    atomic_write_text(out / "report.md", to_markdown(blocks, out))
    atomic_write_text(out / "report.html", to_html(blocks, title))
    _remove_stale_figures(out / "figures", blocks)
    return out / "report.md"
