"""Claims: each paper's headline comparison as a paired test over seeds, written to a Markdown table.

A claims file (YAML) lists claims; each names a study directory (relative to the claims file), the cell the paper
says is better, the cell it beats, and the summary metric:

```yaml
title: CPU-scale evidence
claims:
  - id: hgp
    paper: "HGP (Salami et al.), Table 1: HGP 90.16 vs CCVR 65.30 FAA, CIFAR-100, β = 0.05"
    study: ../benchmarks/results/evidence_cpu
    better: hgp
    worse: ccvr
    metric: faa
    diagnosis: "why, when not reproduced (a mechanism-level finding, with where its evidence is)"
```

`worse_study` (optional) reads the beaten cell from another study, e.g. a peers study run beside the headline one.
The two studies must derive their seeds from the same base configs (seed k is the same scenario in both); the
claim checks that every paired seed's `scenario.json` is identical in the two run directories.

For every claim: the per-seed difference better − worse over the seeds both cells finished, its mean, the 95 %
Student-t interval and the count of seeds favouring `better` (`statistics.paired`), and a status —
- `invalid`: a run of either cell failed the validity gate (`evaluation.validity`); the difference is shown but
  cannot support the claim;
- `reproduced`: the interval lies above 0; `not reproduced`: it lies below 0 (the opposite ordering holds);
- `inconclusive`: it contains 0, or fewer than `min_seeds` seeds are paired.
Values are read from the committed study summaries (`summary.json`: per-seed values and validity), never typed in.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path
from typing import Any

from pydantic import Field

from promptfcl.config import ConfigError, StrictModel, read_yaml
from promptfcl.statistics.paired import PairedDifference, paired_difference


class Control(StrictModel):
    """A reference cell shown beside a claim (head-only, local-only, frozen-feature probe, an ablation): its mean over
    seeds and, on the claim's metric, the paired difference of the claim's `better` cell over it."""

    study: str
    cell: str
    metric: str | None = Field(None, description="its summary key (default: the claim's metric)")
    label: str | None = None


class Claim(StrictModel):
    """One paper claim: `better` beats `worse` on `metric` in the study at `study`."""

    id: str
    paper: str
    study: str | None = None
    worse_study: str | None = Field(None, description="the study of `worse` when it is not `study`")
    better: str
    worse: str
    metric: str = "faa"
    lower_is_better: bool = False
    diagnosis: str | None = None
    controls: list[Control] = Field(default_factory=list, description="reference cells shown beside the pair")
    unavailable: str | None = Field(
        None, description="why no valid evidence can be produced here (the claim is then `invalid` with this reason)"
    )


class ClaimsFile(StrictModel):
    """The claims of a document and the least number of paired seeds a verdict needs."""

    title: str = "Claims"
    min_seeds: int = Field(5, ge=2)
    claims: list[Claim] = Field(min_length=1)


def load_claims(path: str | Path) -> tuple[ClaimsFile, Path]:
    from pydantic import ValidationError

    from promptfcl.config import format_validation_error

    try:
        return ClaimsFile.model_validate(read_yaml(path)), Path(path).resolve().parent
    except ValidationError as err:
        lines = format_validation_error(err, ClaimsFile)
        raise ConfigError(f"invalid claims file {path}:\n  " + "\n  ".join(lines)) from None


def _row(summary: dict[str, Any], cell: str, where: Path) -> dict[str, Any]:
    for row in summary["rows"]:
        if row["cell"] == cell:
            return row
    cells = ", ".join(r["cell"] for r in summary["rows"])
    raise ConfigError(f"{where}: no cell {cell!r} in its summary.json (cells: {cells})")


def _summary(claim: Claim, where: Path) -> dict[str, Any]:
    path = where / "summary.json"
    if not path.is_file():
        raise ConfigError(f"claim {claim.id}: {path} not found; run the study first (promptfcl study …)")
    return json.loads(path.read_text())


def _check_same_scenarios(claim: Claim, dirs: dict[str, Path], seeds: list[int]) -> None:
    """Cells paired across two studies must have run the same scenario for every paired seed."""
    (a_cell, a_dir), (b_cell, b_dir) = dirs.items()
    for seed in seeds:
        texts = (a_dir / f"seed{seed}" / "scenario.json", b_dir / f"seed{seed}" / "scenario.json")
        if all(p.is_file() for p in texts):
            a, b = (json.loads(p.read_text()) for p in texts)
            if a != b:
                raise ConfigError(
                    f"claim {claim.id}: seed {seed} of {a_cell!r} and {b_cell!r} ran different scenarios "
                    f"({' vs '.join(map(str, texts))}); pair cells whose studies share base configs"
                )


def _per_seed(row: dict[str, Any], metric: str) -> dict[int, float]:
    return {int(s): v[metric] for s, v in (row.get("per_seed") or {}).items() if v.get(metric) is not None}


def _controls(claim: Claim, base: Path, better: dict[int, float], better_dir: Path) -> list[dict[str, Any]]:
    """Each control's per-seed values, failed checks and, on the claim's metric, better − control paired."""
    out = []
    for ctl in claim.controls:
        where = (base / ctl.study).resolve()
        row = _row(_summary(claim, where), ctl.cell, where)
        metric = ctl.metric or claim.metric
        values = _per_seed(row, metric)
        item = {"control": ctl, "metric": metric, "values": values, "failed": row.get("invalid") or {}, "diff": None}
        if metric == claim.metric and not row.get("upper_bound"):
            seeds = sorted(set(values) & set(better))
            _check_same_scenarios(claim, {claim.better: better_dir, ctl.cell: where / ctl.cell}, seeds)
            sign = -1.0 if claim.lower_is_better else 1.0
            with contextlib.suppress(ValueError):  # fewer than two paired seeds: no interval
                item["diff"] = paired_difference(
                    {s: sign * v for s, v in better.items()}, {s: sign * v for s, v in values.items()}
                )
        out.append(item)
    return out


def evaluate_claim(claim: Claim, base: Path, min_seeds: int = 5) -> dict[str, Any]:
    """The claim's paired difference, status and the cells' failed validity checks, from the study summaries."""
    if claim.unavailable or claim.study is None:
        reason = claim.unavailable or "no study named"
        return {"claim": claim.model_dump(), "failed": {}, "difference": None, "status": "invalid", "reason": reason}
    studies = {
        claim.better: (base / claim.study).resolve(),
        claim.worse: (base / (claim.worse_study or claim.study)).resolve(),
    }
    rows = {c: _row(_summary(claim, where), c, where) for c, where in studies.items()}
    values = {cell: _per_seed(row, claim.metric) for cell, row in rows.items()}
    if claim.worse_study:
        _check_same_scenarios(
            claim, {c: d / c for c, d in studies.items()}, sorted(set(values[claim.better]) & set(values[claim.worse]))
        )
    sign = -1.0 if claim.lower_is_better else 1.0
    a = {s: sign * v for s, v in values[claim.better].items()}
    b = {s: sign * v for s, v in values[claim.worse].items()}
    failed = {c: {s: f for s, f in (rows[c].get("invalid") or {}).items()} for c in rows}
    out: dict[str, Any] = {"claim": claim.model_dump(), "failed": failed, "difference": None, "values": values}
    out["controls"] = _controls(claim, base, values[claim.better], studies[claim.better] / claim.better)
    try:
        diff = paired_difference(a, b)
    except ValueError as e:
        out.update(status="inconclusive", reason=str(e))
        return out
    out["difference"] = diff
    if any(failed.values()):
        out["status"] = "invalid"
    elif diff.n < min_seeds:
        out["status"] = "inconclusive"
        out["reason"] = f"{diff.n} paired seeds (needs {min_seeds})"
    else:
        out["status"] = "reproduced" if diff.low > 0 else "not reproduced" if diff.high < 0 else "inconclusive"
    return out


def _fmt_diff(d: PairedDifference | None) -> str:
    return "–" if d is None else f"{d.mean:+.2f} [{d.low:+.2f}, {d.high:+.2f}]"


def _mean_sd(values: dict[int, float]) -> str:
    v = list(values.values())
    if not v:
        return "–"
    return f"{statistics.mean(v):.2f} ± {statistics.stdev(v):.2f}" if len(v) > 1 else f"{v[0]:.2f}"


def _controls_table(c: dict[str, Any], r: dict[str, Any]) -> list[str]:
    """The pair and its controls side by side: mean ± sd over seeds, valid seeds, better − control paired."""
    lines = [
        f"| cell | study | metric | mean ± sd | valid seeds | `{c['better']}` − cell [95 % CI] | seeds favouring |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cell, study in ((c["better"], c["study"]), (c["worse"], c["worse_study"] or c["study"])):
        vals = r["values"][cell]
        valid = len(vals) - len(r["failed"].get(cell, {}))
        diff = r["difference"] if cell == c["worse"] else None
        favour = f"{diff.positive}/{diff.n}" if diff is not None else "–"
        lines.append(f"| `{cell}` | `{study}` | {c['metric']} | {_mean_sd(vals)} | {valid}/{len(vals)} | "
                     f"{_fmt_diff(diff) if diff is not None else '–'} | {favour} |")  # fmt: skip
    for item in r["controls"]:
        ctl, diff = item["control"], item["diff"]
        name = f"{ctl.label} (`{ctl.cell}`)" if ctl.label else f"`{ctl.cell}`"
        valid = len(item["values"]) - len(item["failed"])
        favour = f"{diff.positive}/{diff.n}" if diff is not None else "–"
        lines.append(f"| {name} | `{ctl.study}` | {item['metric']} | {_mean_sd(item['values'])} | "
                     f"{valid}/{len(item['values'])} | {_fmt_diff(diff)} | {favour} |")  # fmt: skip
    return lines


def claims_markdown(claims: ClaimsFile, base: Path, source: str) -> str:
    """The claims document: one table row per claim, then per-claim details (seeds, failed checks, diagnosis)."""
    results = [evaluate_claim(c, base, claims.min_seeds) for c in claims.claims]
    lines = [
        f"# {claims.title}",
        "",
        f"Generated by `promptfcl claims {source}` from the committed study summaries — do not edit by hand.",
        "Difference = the advantage of the paper's better cell over the cell it beats (better − worse; worse − "
        "better where lower is better), per seed, its mean and 95 % Student-t interval; a verdict needs "
        f"≥ {claims.min_seeds} paired seeds and every run of both cells passing the validity gate.",
        "",
        "| claim | paper | cells (better vs worse) | metric | difference [95 % CI] | seeds favouring | status |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        c, d = r["claim"], r["difference"]
        favour = f"{d.positive}/{d.n}" if d is not None else "–"
        lines.append(
            f"| {c['id']} | {c['paper']} | `{c['better']}` vs `{c['worse']}` | {c['metric']} | "
            f"{_fmt_diff(d)} | {favour} | **{r['status']}** |"
        )
    lines.append("")
    for r in results:
        c, d = r["claim"], r["difference"]
        where = f"`{c['study']}`" + (f" (`{c['worse']}` from `{c['worse_study']}`)" if c["worse_study"] else "")
        lines += [f"## {c['id']}", "", f"Study: {where}." if c["study"] else "No study."]
        if d is not None:
            per = ", ".join(f"seed {s}: {x:+.2f}" for s, x in zip(d.seeds, d.differences, strict=True))
            lines.append(f"Per-seed advantage ({c['metric']}): {per}.")
        if r.get("reason"):
            lines.append(f"{r['status'].capitalize()} because: {r['reason'].rstrip('.')}.")
        for cell, seeds in r["failed"].items():
            for seed, checks in seeds.items():
                lines.append(f"- `{cell}` seed {seed} failed the validity gate: {', '.join(checks)}.")
        if r.get("controls"):
            lines += ["", *_controls_table(c, r)]
        if c.get("diagnosis"):
            lines += ["", c["diagnosis"].strip()]
        lines.append("")
    return "\n".join(lines)


def write_claims(path: str | Path, out: str | Path) -> str:
    claims, base = load_claims(path)
    text = claims_markdown(claims, base, str(path))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    return text
