"""Studies: one YAML file, many runs (cells × seeds) under one protocol, one comparison table.

```yaml
name: hgp_cifar100_cpu
base: ../configs/cpu/hgp_cifar100_beta0.05.yaml   # relative to this file
seeds: [0, 1, 2]
set: [eval.batch_size=128]                         # overrides for every cell (optional)
sweep: {scenario.partition.beta: [0.5, 0.05]}      # grid for every cell (optional)
cells:
  fedavg_prompt: {method: {name: fedavg_prompt, length: 20, local_epochs: 1}}
  hgp:           {set: [method.rebalance=all]}     # keeps the base's method section
  hgp_lr:        {sweep: {method.lr: [0.001, 0.003]}}
  hepco:         {base: ../configs/cpu/hepco_cifar100.yaml}   # another scenario family
```

A cell may name its own `base` (relative to the study file). A cell with `probe: true` is the family's frozen-feature
reference row: instead of training it runs the linear / nearest-class-mean probe of the frozen backbone on the
training images and classes of its scenario (`promptfcl.frozen_probe`). Its `method` mapping replaces the base's method
section (methods have different keys); its `engine` mapping (e.g. `{kind: flower-sim}`) is merged into the base's
engine section, so its runs record the engine in their config and `promptfcl run` (and `--resume`) use it; its `set`
list is applied after both. `sweep` (study-wide and per cell,
the cell's list wins for a key both name) expands a cell into the cartesian grid of its values, each point a
cell of its own named `<cell>-<key>=<value>…` (key: the last part of the dotted path) with the point's
overrides applied last. Each (cell, seed) runs in `OUT/<cell>/seed<k>/` as its own `promptfcl run` process:
finished runs (a `metrics.json`) are never redone, interrupted ones resume from their checkpoint (a run started
under another config than its cell's now is refused, or with `--rerun-changed` moved aside and run again:
`stale_runs`), and up to `jobs` run at once with the CPU threads split between them, seed by seed (every
cell's first seed before any second one, so partial results already compare every cell). The table (mean ± std
over seeds) goes to `OUT/summary.{md,csv,json}`, the plan of cells to `OUT/study.json` (what `promptfcl report
OUT` reads). `direct_cell` names the cell whose runs are the direct single-task reference for the transfer metrics (FWT,
total transfer) of asynchronous (Powder/C2Prompt) runs; they are computed at summary time, per seed.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from promptfcl.checkpoint import atomic_write_text, has_checkpoint
from promptfcl.config import (
    ConfigError,
    ExperimentConfig,
    StrictModel,
    apply_overrides,
    build_config,
    dotted_keys,
    dump_config,
    read_yaml,
    unset_variables,
)

Sweep = dict[str, list[Any]]


def _check_sweep(sweep: Sweep) -> Sweep:
    for key, values in sweep.items():
        if not key or any(not part for part in key.split(".")):
            raise ValueError(f"sweep key {key!r} must be a dotted config path such as method.lr")
        if not values:
            raise ValueError(f"sweep {key!r} lists no values; give at least one")
        if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
            raise ValueError(f"sweep {key!r} lists a value twice")
    return sweep


class CellConfig(StrictModel):
    """One row of the comparison: a method section and/or overrides on top of the base config."""

    base: str | None = Field(None, description="this cell's base config (relative to the study file)")
    probe: bool = Field(
        False, description="the family's frozen-feature reference row: probe the scenario's data, train nothing"
    )
    method: dict[str, Any] | None = None
    engine: dict[str, Any] | None = Field(
        None,
        description="merged into the base's engine section, e.g. {kind: flower-sim}: the cell's runs record it in "
        "their config and run (and resume) on that engine",
    )
    set: list[str] = Field(default_factory=list)
    sweep: Sweep = Field(default_factory=dict, description="key path -> values; the cell becomes their grid")

    @field_validator("sweep")
    @classmethod
    def _valid_sweep(cls, v: Sweep) -> Sweep:
        return _check_sweep(v)


class StudyConfig(StrictModel):
    """Base config, seeds, shared overrides, shared sweeps and the cells of a study."""

    name: str
    base: str
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    set: list[str] = Field(default_factory=list)
    sweep: Sweep = Field(default_factory=dict, description="key path -> values; every cell becomes their grid")
    missing_weights: Literal["error", "random_init"] = Field(
        "error",
        description="a cell whose backbone.weights file is absent: fail (default), or run on a random-init "
        "backbone (the run is named <study>_<cell>_RANDOM_INIT and reports flag it)",
    )
    cells: dict[str, CellConfig] = Field(min_length=1)
    direct_cell: str | None = Field(
        None,
        description="cell whose runs are the direct single-task reference: every other task-aware cell's FWT and "
        "total transfer are computed against its run of the same seed (asynchronous scenarios)",
    )

    @model_validator(mode="after")
    def _direct_cell_exists(self) -> StudyConfig:
        if self.direct_cell is not None and self.direct_cell not in self.cells:
            raise ValueError(f"direct_cell {self.direct_cell!r} is not one of the cells {sorted(self.cells)}")
        return self

    @field_validator("sweep")
    @classmethod
    def _valid_sweep(cls, v: Sweep) -> Sweep:
        return _check_sweep(v)


@dataclass(frozen=True)
class Cell:
    """A cell after sweep expansion: its name, the study cell it comes from and its sweep point."""

    name: str
    source: str
    point: dict[str, Any] = field(default_factory=dict)

    def overrides(self) -> list[str]:
        return [f"{k}={json.dumps(v)}" for k, v in self.point.items()]


def _label(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def expand_cells(study: StudyConfig) -> list[Cell]:
    """Every cell of the study, each swept cell replaced by the cartesian grid of its sweep values."""
    out: list[Cell] = []
    for name, spec in study.cells.items():
        sweep = {**study.sweep, **spec.sweep}
        if not sweep:
            out.append(Cell(name, name))
            continue
        keys = list(sweep)
        short = [k.rsplit(".", 1)[-1] for k in keys]
        names = [s if short.count(s) == 1 else k for s, k in zip(short, keys, strict=True)]
        for values in itertools.product(*(sweep[k] for k in keys)):
            label = "-".join(f"{n}={_label(v)}" for n, v in zip(names, values, strict=True))
            out.append(Cell(f"{name}-{label}", name, dict(zip(keys, values, strict=True))))
    seen: set[str] = set()
    for cell in out:
        if cell.name in seen:
            raise ConfigError(f"study {study.name}: two cells are both named {cell.name!r}; rename one")
        seen.add(cell.name)
    return out


@dataclass(frozen=True)
class StudyRun:
    """One (cell, seed) of a study: its resolved config file and run directory."""

    cell: str
    seed: int
    config_path: Path
    run_dir: Path
    probe: bool = False

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


def cell_config(study: StudyConfig, study_dir: Path, cell: str | Cell, seed: int) -> ExperimentConfig:
    """The validated experiment config of one (cell, seed): base, the cell's method and overrides, sweep point."""
    if isinstance(cell, str):
        cell = Cell(cell, cell)
    spec = study.cells[cell.source]
    try:
        raw = read_yaml(study_dir / (spec.base or study.base))
        if spec.method is not None:
            raw["method"] = dict(spec.method)
        if spec.engine is not None:
            base_engine = raw.get("engine")
            raw["engine"] = {**(base_engine if isinstance(base_engine, dict) else {}), **spec.engine}
        overrides = [*study.set, *spec.set, *cell.overrides(), f"seed={seed}", f"name={study.name}_{cell.name}"]
        cfg = build_config(apply_overrides(raw, overrides))
    except ConfigError as e:
        raise ConfigError(f"study cell {cell.name!r} (seed {seed}): {e}") from None
    weights = cfg.backbone.weights
    # an unset environment variable in the path is a machine to fix (check_config reports it), not weights to skip
    absent = bool(weights) and not unset_variables(weights) and not Path(str(weights)).is_file()
    if study.missing_weights == "random_init" and absent:
        cfg.backbone.weights = None
        cfg.name = f"{cfg.name}_RANDOM_INIT"
    return cfg


def plan(study: StudyConfig, study_dir: Path, out: Path) -> list[StudyRun]:
    """Resolve and validate every (cell, seed) config up front; write them under `out/configs/` and the plan
    (cells, sweep points, seeds) to `out/study.json`."""
    from promptfcl.runtime import check_config

    cells = expand_cells(study)
    configs = {(c.name, s): cell_config(study, study_dir, c, s) for s in study.seeds for c in cells}  # seed-major
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
        probe = study.cells[next(c.source for c in cells if c.name == cell)].probe
        runs.append(StudyRun(cell, seed, path, out / cell / f"seed{seed}", probe))
    plan_json = {
        "study": study.name,
        "seeds": study.seeds,
        "cells": [{"name": c.name, "source": c.source, "sweep": c.point} for c in cells],
        "direct_cell": study.direct_cell,
    }
    atomic_write_text(out / "study.json", json.dumps(plan_json, indent=2))
    return runs


def select_runs(study: StudyConfig, runs: list[StudyRun], cells: str | None, seeds: str | None) -> list[StudyRun]:
    """The runs of the named cells (a study cell's name selects every sweep point of it) and seeds; None: all."""
    if cells:
        wanted = {c.strip() for c in cells.split(",") if c.strip()}
        names = {c.name: c.source for c in expand_cells(study)}
        unknown = sorted(wanted - set(names) - set(names.values()))
        if unknown:
            raise ConfigError(f"study {study.name}: no cell {', '.join(unknown)} (cells: {', '.join(names)})")
        runs = [r for r in runs if r.cell in wanted or names[r.cell] in wanted]
    if seeds:
        try:
            chosen = {int(s) for s in seeds.split(",") if s.strip()}
        except ValueError:
            raise ConfigError(f"--seeds {seeds!r}: give comma-separated integers, e.g. --seeds 0,1") from None
        missing = sorted(chosen - set(study.seeds))
        if missing:
            raise ConfigError(f"study {study.name}: seeds {missing} are not among its seeds {study.seeds}")
        runs = [r for r in runs if r.seed in chosen]
    return runs


PATH_KEYS = ("data.root", "backbone.weights")  # where the same files lie on this machine: not part of the run
LABEL_KEYS = ("name",)  # the run's label (`<study>_<cell>`): a run moved to another study computes the same


def _resolved(raw: dict[str, Any]) -> dict[str, Any]:
    """A config as the run sees it, flattened: validated, and the method section with its defaults filled in (a
    method parameter written out at its default is no change)."""
    from promptfcl.runtime import resolve_method

    cfg = build_config(raw)
    out = cfg.model_dump(mode="json")
    out["method"] = {"name": cfg.method.name, **resolve_method(cfg)[1].model_dump(mode="json")}
    return dotted_keys(out)


def changed_keys(run: StudyRun) -> list[str] | None:
    """The config keys a started run (its `config.yaml`) differs in from its cell's config now, compared after
    validation with every default filled in (so a field added later, or one written out, at its default is no
    change) and without the machine's paths or the run's
    name (a run moved from one study to another that shares its base configs is the same run); None when
    the run has not started (or is a probe row)."""
    saved = run.run_dir / "config.yaml"
    if run.probe or not saved.is_file():
        return None
    now = _resolved(read_yaml(run.config_path))
    try:
        then = _resolved(read_yaml(saved))
    except ConfigError as e:
        return [f"(its config no longer validates: {str(e).splitlines()[0]})"]
    keys = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
    ignored = (*PATH_KEYS, *LABEL_KEYS)
    return [k for k in keys if k not in ignored and not k.startswith(tuple(f"{p}." for p in PATH_KEYS))]


def stale_runs(runs: list[StudyRun], rerun: bool = False) -> list[StudyRun]:
    """Started runs whose cell config has changed since (`changed_keys`). A study must not average seeds run under
    different configs: without `rerun` this raises a ConfigError that names them and the keys; with `rerun` each
    is moved aside to `seed<k>.replaced-<n>/` (kept, never deleted) so that it runs again. Returns them."""
    stale = [(r, keys) for r in runs if (keys := changed_keys(r))]
    if stale and not rerun:
        lines = [f"{r.cell} seed {r.seed} ({r.run_dir}): {', '.join(keys[:6])}{' …' if len(keys) > 6 else ''}"
                 for r, keys in stale]  # fmt: skip
        raise ConfigError(
            f"{len(stale)} run(s) of this study were started with another config than their cell's now:\n  "
            + "\n  ".join(lines)
            + "\nrestore the cells' configs, or pass --rerun-changed to move those runs aside and run them again"
        )
    for r, _ in stale:
        n = 1
        while (aside := r.run_dir.with_name(f"{r.run_dir.name}.replaced-{n}")).exists():
            n += 1
        r.run_dir.rename(aside)
        log = r.run_dir.with_name(f"{r.run_dir.name}.log")
        if log.is_file():
            log.rename(aside.with_name(f"{aside.name}.log"))
    return [r for r, _ in stale]


def _command(run: StudyRun) -> list[str]:
    cmd = [sys.executable, "-m", "promptfcl", "run", "--quiet"]
    if run.probe:
        return [*cmd, "--probe", str(run.config_path), "--run-dir", str(run.run_dir)]
    if has_checkpoint(run.run_dir):
        return [*cmd, "--resume", str(run.run_dir)]
    return [*cmd, str(run.config_path), "--run-dir", str(run.run_dir)]


def execute(runs: list[StudyRun], jobs: int = 1, on_done: Any = None) -> list[tuple[StudyRun, int]]:
    """Run every unfinished run, `jobs` at a time, each with its share of the CPU threads.

    The share is over the runs that can actually run at once: a lone remaining run gets every core. On
    SIGINT / SIGTERM (or Ctrl-C) no further run starts, the running ones get SIGINT (each checkpoints its last
    completed round and exits), and the interrupt propagates once they have stopped; running the same study again
    resumes them.
    """
    todo = [r for r in runs if not r.finished]
    threads = max(1, (os.cpu_count() or 1) // max(min(jobs, len(todo)), 1))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    stopping = threading.Event()
    running: dict[int, subprocess.Popen] = {}
    lock = threading.Lock()

    def one(run: StudyRun) -> tuple[StudyRun, int] | None:
        with lock:
            if stopping.is_set():
                return None
            run.run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run.run_dir.parent / f"seed{run.seed}.log", "a")  # noqa: SIM115 - closed below
            proc = subprocess.Popen(_command(run), env=env, stdout=log, stderr=subprocess.STDOUT)
            running[proc.pid] = proc
        try:
            rc = proc.wait()
        finally:
            log.close()
            with lock:
                running.pop(proc.pid, None)
        if on_done is not None and not stopping.is_set():
            on_done(run, rc)
        return run, rc

    pool = ThreadPoolExecutor(max_workers=max(jobs, 1))
    futures = [pool.submit(one, r) for r in todo]
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None
    try:
        results = [f.result() for f in futures]
    except KeyboardInterrupt:
        with lock:
            stopping.set()
            procs = list(running.values())
        for proc in procs:  # a terminal's Ctrl-C reaches them too; a signal sent to the study alone does not
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    pool.shutdown()
    return [r for r in results if r is not None]


def summarize_study(study: StudyConfig, out: Path) -> str:
    """Mean ± std over seeds per cell → summary.md / .csv / .json; returns the Markdown table."""
    from promptfcl.report.collect import aggregate, groups_from_study

    rows, columns = aggregate(groups_from_study(out))
    table = markdown_table(rows, columns)
    atomic_write_text(out / "summary.md", f"# {study.name}\n\n{table}\n")
    buf = io.StringIO()
    w = csv.writer(buf)
    sweep_keys = sorted({k for r in rows for k in r["sweep"]})
    bounds = ["upper_bound"] if any(r.get("upper_bound") for r in rows) else []  # only when a row is one
    head = ["cell", "method", "seeds", "valid_seeds", *bounds, *sweep_keys]
    w.writerow(head + [f"{c} {s}" for c in columns for s in ("mean", "std")])
    for row in rows:
        vals = [x for c in columns for x in (row["values"].get(c) or ("", ""))]
        ub = [row.get("upper_bound") or ""] if bounds else []
        w.writerow(
            [
                row["cell"],
                row["method"],
                row["seeds"],
                row["valid_seeds"],
                *ub,
                *(row["sweep"].get(k, "") for k in sweep_keys),
                *vals,
            ]  # fmt: skip
        )
    atomic_write_text(out / "summary.csv", buf.getvalue())
    atomic_write_text(
        out / "summary.json", json.dumps({"study": study.name, "columns": columns, "rows": rows}, indent=2)
    )
    return table


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """The comparison table: one row per cell, mean ± std over its seeds (just the mean for one seed)."""
    from promptfcl.report.collect import format_value, row_label, validity_label

    header = "| cell | method | seeds | valid | " + " | ".join(columns) + " |"
    lines = [header, "|" + " --- |" * (4 + len(columns))]
    for row in rows:
        vals = [format_value(row["values"].get(c), row["seeds"]) for c in columns]
        head = f"| {row_label(row)} | {row['method']} | {row['seeds']} | {validity_label(row)} | "
        lines.append(head + " | ".join(vals) + " |")
    return "\n".join(lines)
