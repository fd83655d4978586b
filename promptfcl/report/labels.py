"""Readable column headers of the comparison reports, defined in one place.

Every summary key a run's `metrics.json` can hold (and the communication / timing / seed columns) maps to a
header with its unit and a one-line definition; the definitions of a table's columns are printed under it.
`column_label` turns a column of `collect.aggregate` (the names `summary.{csv,json}` keep, which other tools read:
`FAA (%)`, `task_accuracy.1`, `MB / round` …) into its header; a key not listed here keeps its raw name.
Units: `%` for accuracies and ratios, `pts` (percentage points) for differences of accuracies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from promptfcl.report.collect import column_key


@dataclass(frozen=True)
class Label:
    """A column's header (with its unit) and the definition printed under tables that show it."""

    header: str
    note: str = ""


LABELS: dict[str, Label] = {
    "faa": Label(
        "final avg acc (%)",
        "average accuracy over all tasks after the last one (HGP's FAA, HePCo's A_N; task-aware rows: over the "
        "(client, task) pairs trained by the end)",
    ),
    "average_forgetting": Label(
        "forgetting (pts)", "mean drop of each old task's accuracy from its best earlier value (Chaudhry et al.)"
    ),
    "bwt": Label("BWT (pts)", "backward transfer: mean change of each old task's accuracy since it was learned"),
    "sample_weighted_accuracy": Label("sample-weighted acc (%)", "accuracy over every test sample of the seen tasks"),
    "acc": Label(
        "avg acc over stages (%)",
        "mean over stages of the mean accuracy of the (client, task) pairs trained so far (C2Prompt's Avg)",
    ),
    "aia": Label(
        "AIA (%)",
        "time-averaged accuracy: mean over every evaluated round of the accuracy on the tasks trained so far "
        "(equals the stage average when only stage ends are evaluated)",
    ),
    "fwt": Label("FWT (pts)", "forward transfer: finished tasks' accuracy minus the direct single-task reference's"),
    "total_transfer": Label("total transfer (pts)", "(Σ FWT + Σ BWT) / stages, Powder's total transfer"),
    "kr_t": Label("KR_t (%)", "temporal retention: per client, accuracy on its first task now / when learned"),
    "kr_s": Label(
        "KR_s (%)", "spatial retention: per client, the global model's / its local model's accuracy on its task"
    ),
    "class_groups.overall": Label("overall acc (%)", "accuracy over all classes of the long-tailed task"),
    "class_groups.head": Label(
        "head-class acc (%)",
        "accuracy on the head / mid / tail classes (the most frequent training classes up to 75 % of the images, "
        "up to 95 %, the rest; scenario.long_tail head_share / mid_share)",
    ),
    "class_groups.mid": Label("mid-class acc (%)"),
    "class_groups.tail": Label("tail-class acc (%)"),
    "probe_linear": Label("linear probe acc (%)", "frozen-feature probes: a linear classifier on the frozen features"),
    "probe_ncm": Label("NCM probe acc (%)", "nearest class mean on the frozen features"),
    "probe_task_aware": Label("task-aware probe acc (%)", "the linear probe restricted to each task's classes"),
    "probe_c": Label("probe C", "the linear probe's inverse L2 strength, chosen on the training images"),
    "mb_per_round": Label("comm / round (MB)", "bytes up + down per round"),
    "wall_time": Label("wall time (s)", "one run, end to end (runs that shared the CPU are slower)"),
    "seeds": Label("seeds", "finished seeds; values are mean ± std over them"),
    "valid_seeds": Label("valid seeds", "seeds that pass the validity gate (the checks the others failed in brackets)"),
}

PATTERNS: list[tuple[re.Pattern[str], Label]] = [
    (
        re.compile(r"task_accuracy\.(\d+)"),
        Label("task {0} acc (%)", "final accuracy of each client's k-th task on its local test split, over clients"),
    ),
]


def label(key: str) -> Label:
    """The header and definition of a summary key (`faa`, `task_accuracy.3`); an unknown key keeps its name."""
    if key in LABELS:
        return LABELS[key]
    for pattern, lab in PATTERNS:
        if m := pattern.fullmatch(key):
            return Label(lab.header.format(*m.groups()), lab.note)
    return Label(key)


def column_label(column: str) -> str:
    """The header of a column of `collect.aggregate` (`FAA (%)` → `final avg acc (%)`)."""
    return label(column_key(column)).header


def column_headers(columns: list[str]) -> list[str]:
    """Headers of a table's columns, each unique (a header two columns would share falls back to the raw name)."""
    headers = [column_label(c) for c in columns]
    return [h if headers.count(h) == 1 else c for h, c in zip(headers, columns, strict=True)]


def column_notes(columns: list[str], defined: set[str] | None = None) -> str:
    """The definitions of the given columns (each once; task k columns share one), for the note under a table.
    `defined`: keys already defined earlier in the report, left out here; the keys defined now are added to it."""
    notes: list[str] = []
    seen = defined if defined is not None else set()
    for c in columns:
        key = column_key(c)
        lab = label(key)
        family = next((p for p, _ in PATTERNS if p.fullmatch(key)), None)
        if family is not None:  # one definition for every `task k acc (%)` column
            template = dict(PATTERNS)[family]
            key, lab = family.pattern, Label(template.header.format("k"), template.note)
        if not lab.note or key in seen:
            continue
        seen.add(key)
        notes.append(f"{lab.header}: {lab.note}")
    return "; ".join(notes) + "." if notes else ""
