"""Finished runs → comparison rows: load run directories, group seeds, mean ± std of every table column.

Shared by `promptfcl study` (summary files), `promptfcl compare RUN_DIR…` and `promptfcl report STUDY_DIR`.
Columns are FAA (HGP's FAA, HePCo's A_N), average forgetting and BWT, then every other numeric key a run's
`metrics.json` `summary` holds (e.g. KR of personalised regimes; one level of nesting is flattened to
`outer.inner`), then MB per round (up + down) and wall time. Long-tailed runs' `class_groups` (overall / head /
mid / tail) become `overall (%)` … columns, first, and replace forgetting and BWT when every run has them.
Upper-bound runs (`scenario.upper_bound`, metrics.json `upper_bound`) keep their cell name and carry
`upper_bound` in their row; tables show them as `<cell> [upper bound: centralized]` (`row_label`).
These column names are what `summary.{csv,json}` hold; reports show readable headers (`report.labels`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from promptfcl.config import ConfigError, load_yaml

FIXED_SUMMARY = {"faa": "FAA (%)", "average_forgetting": "forgetting (%)", "bwt": "BWT (%)"}
HIDDEN_SUMMARY = {"sample_weighted_accuracy"}  # in every run's own report; redundant with FAA in the table
# long-tailed regimes: summary.class_groups = {overall, head, mid, tail} → "overall (%)" … columns, shown first;
# when every run has them (single-task long-tailed studies) forgetting and BWT are left out
GROUPS = "class_groups"
TAIL_COLUMNS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "MB / round": lambda m: m["communication"]["mb_per_round"],
    "wall time (s)": lambda m: m["timing"]["total_seconds"],
}
TAIL_KEYS = {"MB / round": "mb_per_round", "wall time (s)": "wall_time"}


def column_key(column: str) -> str:
    """The summary key behind a column of `aggregate` (`FAA (%)` → `faa`, `head (%)` → `class_groups.head`,
    `MB / round` → `mb_per_round`); every other column is a summary key already. The column names themselves stay
    as they are: `summary.{csv,json}` use them and other tools read those (`promptfcl.claims`)."""
    fixed = {v: k for k, v in FIXED_SUMMARY.items()}
    if column in fixed:
        return fixed[column]
    if column in TAIL_KEYS:
        return TAIL_KEYS[column]
    if column.endswith(" (%)"):
        return f"{GROUPS}.{column.removesuffix(' (%)')}"
    return column


@dataclass
class RunResult:
    """One finished run directory: its metrics, resolved config and environment."""

    run_dir: Path
    metrics: dict[str, Any]
    config: dict[str, Any]
    config_text: str
    environment: dict[str, Any]

    @property
    def seed(self) -> int:
        return int(self.metrics.get("seed", self.config.get("seed", 0)))

    def summary_values(self) -> dict[str, float]:
        """Every numeric summary entry, one level of nesting flattened (`head.acc`)."""
        out: dict[str, float] = {}
        for key, value in self.metrics.get("summary", {}).items():
            if isinstance(value, dict):
                for inner, v in value.items():
                    if _is_number(v):
                        out[f"{inner} (%)" if key == GROUPS else f"{key}.{inner}"] = float(v)
            elif _is_number(value):
                out[key] = float(value)
        return out

    def column_values(self) -> dict[str, float]:
        s = self.summary_values()
        vals = {label: s[key] for key, label in FIXED_SUMMARY.items() if key in s}
        vals.update({k: v for k, v in s.items() if k not in FIXED_SUMMARY and k not in HIDDEN_SUMMARY})
        for label, get in TAIL_COLUMNS.items():
            try:
                vals[label] = float(get(self.metrics))
            except (KeyError, TypeError, ValueError):
                continue
        return vals

    @property
    def failed_checks(self) -> list[str]:
        """The validity gate's failed checks ([] when the run is valid or a reference row that trains nothing)."""
        from promptfcl.evaluation.validity import failed_checks

        if self.metrics.get("upper_bound") == "frozen_probe":
            return []
        return failed_checks(self.metrics.get("validity"))

    @property
    def total_mb(self) -> float:
        comm = self.metrics.get("communication", {})
        return (comm.get("bytes_up", 0) + comm.get("bytes_down", 0)) / 1e6


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def load_run(run_dir: str | Path) -> RunResult:
    """A finished run directory (it must hold metrics.json and config.yaml)."""
    d = Path(run_dir)
    if not (d / "metrics.json").is_file():
        raise ConfigError(f"{d} holds no finished run (no metrics.json); finish it with promptfcl run --resume {d}")
    text = (d / "config.yaml").read_text() if (d / "config.yaml").is_file() else ""
    env_path = d / "environment.json"
    return RunResult(
        d,
        json.loads((d / "metrics.json").read_text()),
        (load_yaml(text) or {}) if text else {},
        text,
        json.loads(env_path.read_text()) if env_path.is_file() else {},
    )


@dataclass
class Group:
    """Runs that differ only by seed: one row of the comparison."""

    name: str
    runs: list[RunResult]
    sweep: dict[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return self.runs[0].metrics.get("method", "") if self.runs else ""

    @property
    def upper_bound(self) -> str | None:
        """ "centralized" / "joint" when the group's runs are an upper-bound row (scenario.upper_bound), else None."""
        if not self.runs:
            return None
        run = self.runs[0]
        return run.metrics.get("upper_bound") or (run.config.get("scenario") or {}).get("upper_bound")


def groups_from_runs(run_dirs: list[str | Path]) -> list[Group]:
    """Group run directories whose configs are equal up to seed and name; label each by its config name."""
    groups: dict[str, Group] = {}
    for d in run_dirs:
        run = load_run(d)
        key_cfg = {k: v for k, v in run.config.items() if k not in ("seed", "name", "output_dir")}
        key = json.dumps(key_cfg, sort_keys=True) if run.config else str(run.run_dir)
        if key not in groups:
            label = run.config.get("name") or run.metrics.get("run") or run.run_dir.name
            label = label.removesuffix(f"_seed{run.seed}")
            taken = {g.name for g in groups.values()}
            base, k = label, 2
            while label in taken:
                label, k = f"{base} ({k})", k + 1
            groups[key] = Group(label, [])
        groups[key].runs.append(run)
    for g in groups.values():
        g.runs.sort(key=lambda r: r.seed)
    return list(groups.values())


def groups_from_study(study_dir: str | Path) -> list[Group]:
    """The cells of a study directory (its study.json), each with its finished seeds, in study order."""
    out = Path(study_dir)
    plan_path = out / "study.json"
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        cells = [(c["name"], c.get("sweep", {})) for c in plan["cells"]]
        seeds = plan["seeds"]
    else:  # a study directory written before study.json existed: every <cell>/seed<k>/ found, in summary order
        found = [p.name for p in sorted(out.iterdir()) if p.is_dir() and any(p.glob("seed*/metrics.json"))]
        summary = out / "summary.json"
        order = [r["cell"] for r in json.loads(summary.read_text())["rows"]] if summary.is_file() else []
        cells = [(c, {}) for c in sorted(found, key=lambda c: order.index(c) if c in order else len(order))]
        seeds = None
    if not cells:
        raise ConfigError(f"{out} is not a study directory (no study.json and no <cell>/seed<k>/ runs)")
    groups = []
    for name, sweep in cells:
        dirs = [out / name / f"seed{s}" for s in seeds] if seeds is not None else sorted((out / name).glob("seed*"))
        groups.append(Group(name, [load_run(d) for d in dirs if (d / "metrics.json").is_file()], sweep))
    if plan_path.is_file() and plan.get("direct_cell"):
        apply_direct_reference(groups, plan["direct_cell"])
    return groups


def apply_direct_reference(groups: list[Group], direct: str) -> None:
    """Recompute (in memory) the summary of every task-aware per-(client, task) run against the `direct` group's
    run of the same seed, so FWT and total transfer appear in the table (Powder's *_direct reference)."""
    from promptfcl.evaluation.regimes import points_from_log, slot_summary
    from promptfcl.report.results import clean_json
    from promptfcl.scenario.scenario import Scenario

    reference = {r.seed: r for g in groups if g.name == direct for r in g.runs}
    for g in groups:
        if g.name == direct:
            continue
        for run in g.runs:
            ref = reference.get(run.seed)
            if ref is None or "evaluations" not in run.metrics or "evaluations" not in ref.metrics:
                continue
            scenario = Scenario.load(run.run_dir / "scenario.json")
            summary = slot_summary(scenario, run.metrics["evaluations"], points_from_log(ref.metrics["evaluations"]))
            run.metrics["summary"] = clean_json(summary)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate(groups: list[Group]) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, columns): per group mean ± std over its runs of every column any run has."""
    extra: list[str] = []
    per_group = []
    for g in groups:
        vals = [r.column_values() for r in g.runs]
        per_group.append(vals)
        for v in vals:
            extra += [k for k in v if k not in extra]
    fixed, tail = list(FIXED_SUMMARY.values()), list(TAIL_COLUMNS)
    runs = [r for g in groups for r in g.runs]
    grouped = [c for c in extra if c.endswith(" (%)") and c not in fixed]
    if runs and all(GROUPS in r.metrics.get("summary", {}) for r in runs):
        fixed = [c for c in fixed if c not in ("forgetting (%)", "BWT (%)")]
        fixed = grouped + fixed
    else:
        fixed = fixed + grouped
    known = {*FIXED_SUMMARY.values(), *grouped, *tail}
    columns = fixed + [c for c in extra if c not in known] + tail
    rows = []
    for g, vals in zip(groups, per_group, strict=True):
        values: dict[str, tuple[float, float] | None] = {}
        for c in columns:
            xs = [v[c] for v in vals if c in v]
            values[c] = mean_std(xs) if xs else None
        invalid = {str(r.seed): r.failed_checks for r in g.runs if r.failed_checks}
        rows.append(
            {
                "cell": g.name,
                "method": g.method,
                "seeds": len(g.runs),
                "sweep": g.sweep,
                "upper_bound": g.upper_bound,
                "values": values,
                "valid_seeds": len(g.runs) - len(invalid),
                "invalid": invalid,
                "per_seed": {str(r.seed): r.summary_values() for r in g.runs},
            }
        )
    return rows, columns


def row_label(row: dict[str, Any]) -> str:
    """A table row's name: the cell, marked when it is an upper bound rather than a federated method, and flagged
    when a seed failed the validity gate."""
    bound = row.get("upper_bound")
    label = f"{row['cell']} [upper bound: {bound}]" if bound else row["cell"]
    return f"{label} ⚠ INVALID" if row.get("invalid") else label


def validity_label(row: dict[str, Any]) -> str:
    """`5/5`, or `3/5 (client_loss, prompt_effect)` naming the checks the failing seeds missed."""
    if not row["seeds"]:
        return "–"
    failed = sorted({c for checks in (row.get("invalid") or {}).values() for c in checks})
    text = f"{row.get('valid_seeds', row['seeds'])}/{row['seeds']}"
    return f"{text} ({', '.join(failed)})" if failed else text


def format_value(value: tuple[float, float] | list[float] | None, seeds: int, digits: int = 2) -> str:
    """`mean ± std` over seeds (just the mean for one seed); `–` where no run has the column."""
    if value is None:
        return "–" if seeds else "not run"
    mean, std = value
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if seeds > 1 else f"{mean:.{digits}f}"
