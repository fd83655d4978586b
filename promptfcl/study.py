"""Studies: one YAML file, many runs (cells × seeds) under one protocol, one comparison table.

```yaml
name: hgp_cifar100_cpu
base: ../configs/cpu/hgp_cifar100_beta0.05.yaml   # relative to this file
seeds: [0, 1, 2]
set: [eval.batch_size=128]                         # overrides for every cell (optional)
cells:
  fedavg_prompt: {method: {name: fedavg_prompt, length: 20, local_epochs: 1}}
  hgp:           {set: [method.rebalance=all]}     # keeps the base's method section
```

A cell's `method` mapping replaces the base's method section (methods have different keys); its `set` list
is applied after it. Each (cell, seed) runs in `OUT/<cell>/seed<k>/` as its own `promptfcl run` process:
finished runs (a `metrics.json`) are never redone, interrupted ones resume from their checkpoint, and up to
`jobs` run at once with the CPU threads split between them. The table (mean ± std over seeds) goes to
`OUT/summary.{md,csv,json}`.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from promptfcl.checkpoint import atomic_write_text
from promptfcl.config import (
    ConfigError,
    ExperimentConfig,
    StrictModel,
    apply_overrides,
    build_config,
    dump_config,
    read_yaml,
)


class CellConfig(StrictModel):
    """One row of the comparison: a method section and/or overrides on top of the base config."""

    method: dict[str, Any] | None = None
    set: list[str] = Field(default_factory=list)


class StudyConfig(StrictModel):
    """Base config, seeds, shared overrides and the cells of a study."""

    name: str
    base: str
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    set: list[str] = Field(default_factory=list)
    cells: dict[str, CellConfig] = Field(min_length=1)
    columns: list[Literal["per_task", "retention"]] = Field(
        default_factory=list,
        description="extra table columns: per_task = final accuracy on each task; retention = final KR_t / KR_s",
    )


@dataclass(frozen=True)
class StudyRun:
    """One (cell, seed) of a study: its resolved config file and run directory."""

    cell: str
    seed: int
    config_path: Path
    run_dir: Path

    @property
    def finished(self) -> bool:
        return (self.run_dir / "metrics.json").is_file()


def load_study(path: str | os.PathLike[str]) -> tuple[StudyConfig, Path]:
    from pydantic import ValidationError

    from promptfcl.config import format_validation_error

    raw = read_yaml(path)
    try:
        study = StudyConfig.model_validate(raw)
    except ValidationError as err:
        lines = format_validation_error(err, StudyConfig)
        raise ConfigError(f"invalid study {path}:\n  " + "\n  ".join(lines)) from None
    return study, Path(path).resolve().parent


def cell_config(study: StudyConfig, study_dir: Path, cell: str, seed: int) -> ExperimentConfig:
    """The validated experiment config of one (cell, seed): base, then the cell's method and overrides."""
    spec = study.cells[cell]
    raw = read_yaml(study_dir / study.base)
    if spec.method is not None:
        raw["method"] = dict(spec.method)
    raw = apply_overrides(raw, [*study.set, *spec.set, f"seed={seed}", f"name={study.name}_{cell}"])
    try:
        return build_config(raw)
    except ConfigError as e:
        raise ConfigError(f"study cell {cell!r} (seed {seed}): {e}") from None


def plan(study: StudyConfig, study_dir: Path, out: Path) -> list[StudyRun]:
    """Resolve and validate every (cell, seed) config up front; write them under `out/configs/`."""
    from promptfcl.runtime import check_config

    configs = {(c, s): cell_config(study, study_dir, c, s) for c in study.cells for s in study.seeds}
    for (cell, seed), cfg in configs.items():  # registries, data files, method parameters: before anything runs
        try:
            check_config(cfg)
        except ConfigError as e:
            raise ConfigError(f"study cell {cell!r} (seed {seed}): {e}") from None
    runs = []
    for (cell, seed), cfg in configs.items():
        path = out / "configs" / f"{cell}_seed{seed}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_config(cfg))
        runs.append(StudyRun(cell, seed, path, out / cell / f"seed{seed}"))
    return runs


def _command(run: StudyRun) -> list[str]:
    cmd = [sys.executable, "-m", "promptfcl", "run", "--quiet"]
    if (run.run_dir / "checkpoint.safetensors").is_file():
        return [*cmd, "--resume", str(run.run_dir)]
    return [*cmd, str(run.config_path), "--run-dir", str(run.run_dir)]


def execute(runs: list[StudyRun], jobs: int = 1, on_done: Any = None) -> list[tuple[StudyRun, int]]:
    """Run every unfinished run, `jobs` at a time, each with its share of the CPU threads."""
    todo = [r for r in runs if not r.finished]
    threads = max(1, (os.cpu_count() or 1) // max(jobs, 1))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}

    def one(run: StudyRun) -> tuple[StudyRun, int]:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        with open(run.run_dir.parent / f"seed{run.seed}.log", "a") as log:
            rc = subprocess.call(_command(run), env=env, stdout=log, stderr=subprocess.STDOUT)
        if on_done is not None:
            on_done(run, rc)
        return run, rc

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        return list(pool.map(one, todo))


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _fmt(value: tuple[float, float] | None, seeds: int, digits: int) -> str:
    if value is None:
        return "not run"
    return f"{value[0]:.{digits}f} ± {value[1]:.{digits}f}" if seeds > 1 else f"{value[0]:.{digits}f}"


COLUMNS = [
    ("FAA (%)", lambda m: m["summary"]["faa"]),
    ("forgetting (%)", lambda m: m["summary"]["average_forgetting"]),
    ("BWT (%)", lambda m: m["summary"]["bwt"]),
    ("MB / round", lambda m: m["communication"]["mb_per_round"]),
    ("wall time (s)", lambda m: m["timing"]["total_seconds"]),
]


GROUP_COLUMNS = [
    (f"{g} (%)", lambda m, g=g: m["summary"]["class_groups"][g]) for g in ("overall", "head", "mid", "tail")
]


def _task_column(i: int) -> tuple[str, Any]:
    return f"task {i + 1} (%)", lambda m: m["accuracy_matrix"][-1][i] if len(m["accuracy_matrix"][-1]) > i else None


def study_columns(study: StudyConfig, metrics: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The table's columns: class groups first for long-tailed runs; per-task final accuracies and KR_t / KR_s
    before the standard ones when the study asks for them."""
    base = COLUMNS
    if metrics and all("class_groups" in m["summary"] for m in metrics):
        base = GROUP_COLUMNS + [c for c in COLUMNS if c[0] not in ("forgetting (%)", "BWT (%)")]
    extra: list[tuple[str, Any]] = []
    if "per_task" in study.columns:
        tasks = max((len(m["accuracy_matrix"][-1]) for m in metrics if m["accuracy_matrix"]), default=0)
        extra += [_task_column(i) for i in range(tasks)]
    if "retention" in study.columns:
        extra += [
            ("KR_t (%)", lambda m: (m.get("retention") or {}).get("kr_t")),
            ("KR_s (%)", lambda m: (m.get("retention") or {}).get("kr_s")),
        ]
    return extra + base


def summarize_study(study: StudyConfig, runs: list[StudyRun], out: Path) -> str:
    """Mean ± std over seeds per cell → summary.md / .csv / .json; returns the Markdown table.

    Long-tailed studies (runs that report class groups) get overall / head / mid / tail columns first."""
    rows: list[dict[str, Any]] = []
    done_metrics = {r: json.loads((r.run_dir / "metrics.json").read_text()) for r in runs if r.finished}
    columns = study_columns(study, list(done_metrics.values()))
    for cell in study.cells:
        done = [r for r in runs if r.cell == cell and r.finished]
        metrics = [done_metrics[r] for r in done]
        row: dict[str, Any] = {"cell": cell, "method": metrics[0]["method"] if metrics else "", "seeds": len(done)}
        for col, get in columns:
            values = [float(v) for v in (get(m) for m in metrics) if v is not None]
            row[col] = _mean_std(values) if values else None
        rows.append(row)
    header = "| cell | method | seeds | " + " | ".join(c for c, _ in columns) + " |"
    lines = [header, "|" + " --- |" * (3 + len(columns))]
    for row in rows:
        cells = [
            "not run"
            if row[c] is None
            else (f"{row[c][0]:.2f} ± {row[c][1]:.2f}" if row["seeds"] > 1 else f"{row[c][0]:.2f}")
            for c, _ in columns
        ]
        lines.append(f"| {row['cell']} | {row['method']} | {row['seeds']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    atomic_write_text(out / "summary.md", f"# {study.name}\n\n{table}\n")
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["cell", "method", "seeds"] + [f"{c} {s}" for c, _ in columns for s in ("mean", "std")])
    for row in rows:
        vals = [x for c, _ in columns for x in (row[c] or ("", ""))]
        w.writerow([row["cell"], row["method"], row["seeds"], *vals])
    atomic_write_text(out / "summary.csv", buf.getvalue())
    atomic_write_text(out / "summary.json", json.dumps({"study": study.name, "rows": rows}, indent=2))
    return table
