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

For every claim: the per-seed difference better − worse over the seeds on which both cells finished and passed the
validity gate, its mean, the 95 % Student-t interval and the count of seeds favouring `better`
(`statistics.paired`), beside the paper's own difference (`paper_delta`), and a status (defined in `STATUSES`,
printed on the page). A seed where either run failed the gate is left out, named, and put back in a sensitivity
check: a verdict that only holds without it is inconclusive. Before any verdict: every paired seed of the two cells
must have run the identical `scenario.json` (a missing one is an error), and the paired runs must come from one
clean code version (`environment.json` → the commit's git trees of `promptfcl/` and `configs/`, so a commit that
only adds a seed to a study does not split them), unless `provenance_note` says why the versions that differ are
safe. A claim whose runs fail only the gate's learning checks at the largest budget that fits this machine, and
that declares why more rounds do not fit (`budget_limit`), is *inconclusive* rather than *invalid*. A claim can only
be *reproduced* when both cells' mechanisms help in their own runs (their
`*_mechanism` checks, McNemar pooled over the paired seeds, `helps`; or a run-level ablation control's paired
difference, `RUN_LEVEL_RULE`) and the worse cell beats its own head-only control
(`controls: [{role: head_only, …}]`): otherwise the better cell would beat an inert peer. Values are read from
the committed study summaries (`summary.json`) and run directories, never typed in.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from promptfcl.config import ConfigError, StrictModel, read_yaml
from promptfcl.evaluation.validity import LEARNING_CHECKS
from promptfcl.statistics.paired import PairedDifference, paired_difference


class Control(StrictModel):
    """A reference cell shown beside a claim (head-only, local-only, frozen-feature probe, an ablation): its mean over
    seeds and, on the claim's metric, the paired difference of the claim's `better` cell over it."""

    study: str
    cell: str
    metric: str | None = Field(None, description="its summary key (default: the claim's metric)")
    label: str | None = None
    role: Literal["head_only", "local_only"] | None = Field(
        None,
        description="head_only: the worse cell's own head-only control, which the worse cell must beat; "
        "local_only: a local-only control (`method.local_only`), whose prompts may hurt on the global test; "
        "either counts seeds failing only mechanism checks as valid (`ROLE_EXPECTED`)",
    )
    ablates: str | None = Field(
        None,
        description="`<cell>:<check>`: this control is the claim's cell `<cell>` run with the mechanism of its "
        "`<check>` (e.g. `hgp:rebalancing_mechanism`) switched off for the whole run, everything else equal; the "
        "paired difference cell − control on both cells' valid seeds then decides that mechanism's verdict "
        "(`RUN_LEVEL_RULE`); its seeds count unless they fail an integrity check (`ABLATION_INTEGRITY`)",
        pattern=r"^[^:]+:[A-Za-z0-9_]+_mechanism$",
    )

    @model_validator(mode="after")
    def _one_reading(self) -> Control:
        if self.role is not None and self.ablates is not None:  # their seed rules differ: one entry per reading
            raise ValueError(
                f"control {self.cell} has both `role: {self.role}` and `ablates: {self.ablates}`, whose valid-seed "
                "rules differ (a role's control must learn, an ablation's need only have trained); list the cell "
                "twice, once with each"
            )
        return self


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
    paper_delta: float | None = Field(None, description="the paper's own better − worse on this metric, in points")
    finding: str | None = Field(None, description="one or two sentences: the mechanism-level finding")
    diagnosis: str | None = Field(None, description="the finding's long form (its evidence, where to find it)")
    provenance_note: str | None = Field(
        None, description="why paired runs from different (or uncommitted) code are safe to compare, if they are"
    )
    controls: list[Control] = Field(default_factory=list, description="reference cells shown beside the pair")
    unavailable: str | None = Field(
        None, description="why no valid evidence can be produced here (the claim is then `invalid` with this reason)"
    )
    budget_limit: str | None = Field(
        None,
        description="why neither cell can be given more rounds or epochs on this machine; a claim whose runs fail "
        "only the gate's learning checks (LEARNING_CHECKS) at the budget that fits is then `inconclusive` with this "
        "reason instead of `invalid`",
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


STATUSES = {
    "reproduced, margin within the paper's": "the interval lies above 0 and contains the paper's own difference; "
    "both cells' mechanisms help in their own runs and the worse cell beats its head-only control",
    "reproduced, margin above the paper's": "as above, but the whole interval lies above the paper's difference",
    "reproduced, margin below the paper's": "as above, but the whole interval lies below the paper's difference",
    "reproduced": "as above; the paper gives no difference to compare with",
    "not reproduced": "the interval lies below 0: the opposite ordering holds",
    "inconclusive": "the interval contains 0, fewer paired seeds than the verdict needs, the verdict changes when the "
    "seeds that failed the gate are put back, or the ordering holds but "
    "a cell's mechanism is neutral or hurts in its own runs, or the worse cell does not beat its head-only control, "
    f"or a cell fails only the gate's learning checks ({', '.join(LEARNING_CHECKS)}) at the largest budget that fits "
    "this machine and the budget that could fix it does not fit (the reason is given)",
    "invalid": "fewer paired seeds than the verdict needs pass the validity gate in both cells (a mechanism "
    "inactive, or a failure to learn that more rounds on this machine could still fix), the paired runs do "
    "not come from one clean code version (without a stated reason why that is safe), or no valid evidence can be "
    "produced here (the reason is given)",
}


def _run_dir(study: Path, cell: str, seed: int) -> Path:
    return study / cell / f"seed{seed}"


def _check_same_scenarios(claim: Claim, dirs: dict[str, Path], seeds: list[int]) -> None:
    """Paired cells must have run the same scenario for every paired seed (a missing scenario.json is an error)."""
    (a_cell, a_dir), (b_cell, b_dir) = dirs.items()
    for seed in seeds:
        texts = (a_dir / f"seed{seed}" / "scenario.json", b_dir / f"seed{seed}" / "scenario.json")
        missing = [str(p) for p in texts if not p.is_file()]
        if missing:
            raise ConfigError(f"claim {claim.id}: {', '.join(missing)} not found; a paired run must keep its scenario")
        a, b = (json.loads(p.read_text()) for p in texts)
        if a != b:
            raise ConfigError(
                f"claim {claim.id}: seed {seed} of {a_cell!r} and {b_cell!r} ran different scenarios "
                f"({' vs '.join(map(str, texts))}); pair cells whose studies share base configs"
            )


CODE_PATHS = ("promptfcl", "configs")  # what a run's numbers depend on; docs, tests and study lists do not count


def _code_identity(commit: str, repo: Path) -> str:
    """The git tree hashes of `CODE_PATHS` at `commit` (commits whose package and configs are byte-identical share
    it); the commit itself when git cannot tell (no repository, unknown commit)."""
    import subprocess

    specs = [f"{commit}:{path}" for path in CODE_PATHS]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", *specs], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return commit
    return "+".join(line[:10] for line in out.stdout.split())


def provenance(dirs: list[Path], repo: Path | None = None) -> dict[str, Any]:
    """The commits the runs in `dirs` came from (`environment.json` → git), which had uncommitted changes, and the
    code they ran: runs from different commits with byte-identical `CODE_PATHS` (e.g. a commit that only adds a
    seed to a study) ran the same code and count as one provenance."""
    commits: dict[str, list[str]] = {}
    full: dict[str, str] = {}
    dirty: list[str] = []
    for d in dirs:
        env = json.loads((d / "environment.json").read_text()) if (d / "environment.json").is_file() else {}
        git = env.get("git") or {}
        commit = str(git.get("commit") or "unknown")
        commits.setdefault(commit[:10], []).append(f"{d.parent.name}/{d.name}")
        full[commit[:10]] = commit
        if git.get("dirty") or not git.get("commit"):
            dirty.append(f"{d.parent.name}/{d.name}")
    codes = {c: (_code_identity(full[c], repo) if repo is not None and c != "unknown" else c) for c in commits}
    return {"commits": commits, "code": codes, "dirty": dirty, "clean": len(set(codes.values())) == 1 and not dirty}


def mechanism_verdicts(dirs: list[Path], also: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Per mechanism check of the runs (`prompt_mechanism`, `<component>_mechanism`): the paired counts pooled over
    the runs (right only with the component, right only without) and McNemar's verdict on them. `also` names
    mechanisms a claim ablates that the runs do not check (e.g. PILoRA's LoRA, `prompt_mechanism`): their in-run
    counts come from the same measurement (the prompt effect, or the server's ablation of that component)."""
    from promptfcl.evaluation.prompt_effect import mcnemar

    pooled: dict[str, list[int]] = {}
    for d in dirs:
        path = d / "metrics.json"
        if not path.is_file():
            continue
        m = json.loads(path.read_text())
        declared = [c["name"] for c in (m.get("validity") or {}).get("checks", []) if c["name"].endswith("_mechanism")]
        for name in dict.fromkeys([*declared, *also]):
            component = name[: -len("_mechanism")]
            effect = m.get("prompt_effect") if component == "prompt" else (m.get("ablations") or {}).get(component)
            if name not in declared and not (effect and effect.get("gained") is not None):
                continue  # an undeclared mechanism the run did not measure either
            counts = pooled.setdefault(name, [0, 0])
            if effect and effect.get("gained") is not None:
                counts[0] += int(effect["gained"])
                counts[1] += int(effect["lost"])
    out = {}
    for name, (gained, lost) in pooled.items():
        p, verdict = mcnemar(gained, lost)
        out[name] = {"gained": gained, "lost": lost, "p": p, "verdict": verdict}
    return out


def _per_seed(row: dict[str, Any], metric: str) -> dict[int, float]:
    return {int(s): v[metric] for s, v in (row.get("per_seed") or {}).items() if v.get(metric) is not None}


def is_role_expectation(check: str) -> bool:
    """Whether a failed check is one a head-only or local-only control is expected to fail (`ROLE_EXPECTED`)."""
    return check == "prompt_benefit" or check.endswith("_mechanism")


ROLE_EXPECTED = (
    "a head-only control (role head_only, a run without prompts) and a local-only control (role local_only) count "
    "as valid when they learned (every other check passes) even where their mechanism checks fail "
    "(prompt_benefit, *_mechanism): the head-only run has no prompts by construction, and the local-only run's "
    "prompts fit each client's own few classes and may hurt on the global test set, which is what it measures"
)

ABLATION_INTEGRITY = ("backbone_pretrained", "parameters_moved")
"""The checks a run-level ablation control must pass: it ran on the pretrained backbone and trained. Every other
check (learning, benefit, the mechanism's own) measures an outcome the switched-off mechanism may cause - a run
that cannot learn its tasks without the mechanism is the mechanism's effect, not a broken control."""

RUN_LEVEL_RULE = (
    "a mechanism's verdict is McNemar's test on the predictions its in-run ablation changes (the final model with "
    "and without it), unless a control ablates it for the whole run (`ablates: <cell>:<check>`, the same recipe "
    "with the mechanism off from the first round): then the paired run-level difference decides - helps when its "
    "95 % interval lies above 0, hurts when below, else neutral - because a mechanism that feeds back into "
    "training (a server step that every later round starts from) is understated by removing it from the final "
    "model only; with fewer than two paired valid seeds the in-run verdict stands; the ablated run's seeds count "
    "unless they fail an integrity check (" + ", ".join(ABLATION_INTEGRITY) + "), since failing to learn "
    "without the mechanism is its effect"
)


EXPECTED_BECAUSE = {
    "head_only": "as a run without prompts fails its mechanism checks",
    "local_only": "as a local-only control's prompts may on the global test",
    "ablation": "outcomes of the switched-off mechanism",
}


def _role_failures(
    claim: Claim, ctl: Control, cell_dir: Path, failed: dict[int, list[str]], seeds: list[int]
) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """(failures that count, expected ones) of a head-only or local-only control, whose runs must be what the role
    says: local-only runs (`method.local_only`), or runs whose model has no prompts (`prompt_effect` not
    applicable)."""
    for seed in seeds:
        run = cell_dir / f"seed{seed}"
        if ctl.role == "local_only" and not (read_yaml(run / "config.yaml").get("method") or {}).get("local_only"):
            raise ConfigError(f"claim {claim.id}: {cell_dir.name} seed {seed} is not a local-only run "
                              "(method.local_only); drop `role: local_only` from its control")  # fmt: skip
        if ctl.role == "head_only" and seed in failed:
            effect = json.loads((run / "metrics.json").read_text()).get("prompt_effect") or {}
            if effect.get("applicable", False):
                raise ConfigError(f"claim {claim.id}: {cell_dir.name} seed {seed} has prompts (its prompt effect "
                                  "was measured); a head-only control runs without them")  # fmt: skip
    count = {s: f for s, f in failed.items() if not all(is_role_expectation(c) for c in f)}
    return count, {s: f for s, f in failed.items() if s not in count}


def _controls(claim: Claim, base: Path, better: dict[int, float], better_dir: Path) -> list[dict[str, Any]]:
    """Each control's per-seed values, failed checks and, on the claim's metric, better − control paired."""
    out = []
    for ctl in claim.controls:
        where = (base / ctl.study).resolve()
        row = _row(_summary(claim, where), ctl.cell, where)
        metric = ctl.metric or claim.metric
        values = _per_seed(row, metric)
        failed = {int(s): f for s, f in (row.get("invalid") or {}).items()}
        expected: dict[int, list[str]] = {}
        if ctl.role is not None:
            failed, expected = _role_failures(claim, ctl, where / ctl.cell, failed, sorted(values))
        elif ctl.ablates is not None:  # what the switched-off mechanism may cause counts; only integrity fails
            expected = {s: f for s, f in failed.items() if not set(f) & set(ABLATION_INTEGRITY)}
            failed = {s: f for s, f in failed.items() if s not in expected}
        item = {"control": ctl, "metric": metric, "values": values, "failed": failed, "expected": expected,
                "diff": None}  # fmt: skip
        if metric == claim.metric and not row.get("upper_bound"):
            valid = {s: v for s, v in values.items() if s not in failed}  # intervals on the control's valid seeds
            seeds = sorted(set(valid) & set(better))
            _check_same_scenarios(claim, {claim.better: better_dir, ctl.cell: where / ctl.cell}, seeds)
            sign = -1.0 if claim.lower_is_better else 1.0
            with contextlib.suppress(ValueError):  # fewer than two paired seeds: no interval
                item["diff"] = paired_difference(
                    {s: sign * v for s, v in better.items()}, {s: sign * v for s, v in valid.items()}
                )
        out.append(item)
    return out


def evaluate_claim(claim: Claim, base: Path, min_seeds: int = 5) -> dict[str, Any]:
    """The claim's paired difference, status and its reasons, from the study summaries and run directories."""
    if claim.unavailable or claim.study is None:
        reason = claim.unavailable or "no study named"
        return {"claim": claim.model_dump(), "failed": {}, "difference": None, "status": "invalid", "reason": reason}
    studies = {
        claim.better: (base / claim.study).resolve(),
        claim.worse: (base / (claim.worse_study or claim.study)).resolve(),
    }
    rows = {c: _row(_summary(claim, where), c, where) for c, where in studies.items()}
    values = {cell: _per_seed(row, claim.metric) for cell, row in rows.items()}
    seeds = sorted(set(values[claim.better]) & set(values[claim.worse]))
    _check_same_scenarios(claim, {c: d / c for c, d in studies.items()}, seeds)
    sign = -1.0 if claim.lower_is_better else 1.0
    failed = {c: {int(s): f for s, f in (rows[c].get("invalid") or {}).items()} for c in rows}
    excluded = sorted({s for f in failed.values() for s in f} & set(seeds))
    valid = [s for s in seeds if s not in excluded]  # a comparison counts only where both runs pass the gate
    a = {s: sign * values[claim.better][s] for s in valid}
    b = {s: sign * values[claim.worse][s] for s in valid}
    dirs = {c: [_run_dir(studies[c], c, s) for s in valid] for c in studies}
    out: dict[str, Any] = {"claim": claim.model_dump(), "failed": failed, "difference": None, "values": values,
                           "excluded": excluded, "all_seeds": None}  # fmt: skip
    out["provenance"] = provenance([d for ds in dirs.values() for d in ds], base)
    ablated = [tuple(ctl.ablates.split(":")) for ctl in claim.controls if ctl.ablates is not None]
    out["mechanisms"] = {c: mechanism_verdicts(ds, tuple(k for of, k in ablated if of == c)) for c, ds in dirs.items()}
    valid_values = {c: {s: v for s, v in values[c].items() if s not in failed[c]} for c in values}
    out["controls"] = _controls(claim, base, valid_values[claim.better], studies[claim.better] / claim.better)
    _run_level_verdicts(claim, out, valid_values, {c: d / c for c, d in studies.items()}, base)
    gate = "; ".join(
        f"{c} seed {s} failed {', '.join(f)}" for c, seeds_failed in failed.items() for s, f in seeds_failed.items()
    )
    if excluded:
        with contextlib.suppress(ValueError):  # the sensitivity check: the failed seeds put back in
            out["all_seeds"] = paired_difference(
                {s: sign * values[claim.better][s] for s in seeds}, {s: sign * values[claim.worse][s] for s in seeds}
            )
    if len(valid) < min_seeds and excluded:
        reason = f"{len(valid)} paired seeds pass the validity gate (needs {min_seeds}): {gate}"
        only_learning = all(set(f) <= set(LEARNING_CHECKS) for fs in failed.values() for f in fs.values())
        if claim.budget_limit and only_learning:
            out.update(status="inconclusive", reason=f"{reason}; a failure to learn at the largest budget that fits "
                                                     f"here: {claim.budget_limit}")  # fmt: skip
        else:
            out.update(status="invalid", reason=reason)
        with contextlib.suppress(ValueError):
            out["difference"] = paired_difference(a, b)
        return out
    try:
        diff = paired_difference(a, b)
    except ValueError as e:
        out.update(status="inconclusive", reason=str(e))
        return out
    out["difference"] = diff
    prov = out["provenance"]
    if not prov["clean"] and not claim.provenance_note:
        out["status"] = "invalid"
        parts = [f"{len(set(prov['code'].values()))} code version(s) over {len(prov['commits'])} commit(s)"] + (
            [f"{len(prov['dirty'])} run(s) with uncommitted changes"] if prov["dirty"] else [])  # fmt: skip
        out["reason"] = "the paired runs come from " + " and ".join(parts) + " (re-run them from one clean commit)"
    elif diff.n < min_seeds:
        out["status"] = "inconclusive"
        out["reason"] = f"{diff.n} paired seeds (needs {min_seeds})"
    elif diff.high < 0:
        out["status"] = "not reproduced"
    elif diff.low <= 0:
        out["status"] = "inconclusive"
    else:
        out["status"], out["reason"] = _reproduced(claim, diff, out)
    whole = out["all_seeds"]
    decided = out["status"] not in ("inconclusive", "invalid")  # only a verdict can rest on the left-out seeds
    if whole is not None and decided and not (whole.low > 0 or whole.high < 0):
        out["status"] = "inconclusive"  # the verdict rests on leaving the failed seeds out
        out["reason"] = (f"the verdict holds only without the seeds that failed the gate ({gate}); with them the "
                         f"difference is {_fmt_diff(whole)}")  # fmt: skip
    return out


def _run_level_verdicts(
    claim: Claim, out: dict[str, Any], valid: dict[str, dict[int, float]], cell_dirs: dict[str, Path], base: Path
) -> None:
    """Replace a mechanism's in-run verdict with its run-level ablation's, where a control gives one
    (`RUN_LEVEL_RULE`); the in-run verdict is kept beside it."""
    sign = -1.0 if claim.lower_is_better else 1.0
    for item in out["controls"]:
        ctl = item["control"]
        if ctl.ablates is None:
            continue
        cell, check = ctl.ablates.split(":")
        if cell not in (claim.better, claim.worse):
            raise ConfigError(f"claim {claim.id}: control {ctl.cell} ablates {cell!r}, which is neither of the "
                              f"claim's cells ({claim.better}, {claim.worse})")  # fmt: skip
        control = {s: v for s, v in item["values"].items() if s not in item["failed"]}
        seeds = sorted(set(control) & set(valid[cell]))
        _check_same_scenarios(claim, {cell: cell_dirs[cell], ctl.cell: (base / ctl.study).resolve() / ctl.cell}, seeds)
        entry = out["mechanisms"].setdefault(cell, {}).setdefault(check, {"verdict": "not measured in-run"})
        try:
            diff = paired_difference({s: sign * valid[cell][s] for s in seeds}, {s: sign * control[s] for s in seeds})
        except ValueError:  # fewer than two paired valid seeds: the in-run verdict stands
            entry["run_level"] = None
            continue
        verdict = "helps" if diff.low > 0 else "hurts" if diff.high < 0 else "neutral"
        entry.update(in_run=entry["verdict"], run_level=diff, control=ctl.cell, verdict=verdict)


def _mechanism_evidence(v: dict[str, Any]) -> str:
    """What a mechanism verdict rests on: the pooled in-run McNemar counts, or the run-level ablation's paired
    difference with the in-run verdict beside it."""
    in_run = (f"right only with it {v['gained']}, only without {v['lost']}, McNemar p {v['p']:.2g}"
              if "gained" in v else "no in-run ablation")  # fmt: skip
    if v.get("run_level") is None:
        return f"over the paired seeds ({in_run})"
    beside = f"in-run {v['in_run']}: {in_run}" if "gained" in v else in_run
    return f"at run level (− `{v['control']}`: {_fmt_diff(v['run_level'])}; {beside})"


def _reproduced(claim: Claim, diff: PairedDifference, out: dict[str, Any]) -> tuple[str, str | None]:
    """The status of an ordering that held: inconclusive when a cell's mechanism does not help or the worse cell
    does not beat its head-only control, else reproduced with its margin against the paper's."""
    weak = [
        f"{cell}'s {name} is {v['verdict']} {_mechanism_evidence(v)}"
        for cell, checks in out["mechanisms"].items()
        for name, v in checks.items()
        if v["verdict"] != "helps"
    ]
    if weak:
        return "inconclusive", "the ordering holds but " + "; ".join(weak)
    for item in out["controls"]:
        ctl = item["control"]
        if ctl.role != "head_only":
            continue
        worse = {s: v for s, v in out["values"][claim.worse].items() if s not in out["failed"].get(claim.worse, {})}
        sign = -1.0 if claim.lower_is_better else 1.0
        valid = {s: v for s, v in item["values"].items() if s not in item["failed"]}
        try:
            lead = paired_difference({s: sign * v for s, v in worse.items()}, {s: sign * v for s, v in valid.items()})
        except ValueError:  # fewer than two seeds valid in both: the floor is not measured, so nothing is shown
            return "inconclusive", (f"the ordering holds but {claim.worse}'s head-only control ({ctl.cell}) has "
                                    f"fewer than two seeds valid beside {claim.worse}'s, so it is not shown to "
                                    "beat it")  # fmt: skip
        out["worse_over_head_only"] = lead
        if lead.low <= 0:
            return "inconclusive", (f"the ordering holds but {claim.worse} does not beat its head-only control "
                                    f"({_fmt_diff(lead)}): the better cell beats an inert peer")  # fmt: skip
    if claim.paper_delta is None:
        return "reproduced", None
    if diff.low > claim.paper_delta:
        return "reproduced, margin above the paper's", None
    if diff.high < claim.paper_delta:
        return "reproduced, margin below the paper's", None
    return "reproduced, margin within the paper's", None


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


def claims_markdown(claims: ClaimsFile, base: Path, source: str, diagnoses: str | None = None) -> str:
    """The claims document: the statuses, one table row per claim, then per claim its seeds, provenance, mechanism
    verdicts, controls and short finding (linking to its long form in `diagnoses`, when given)."""
    results = [evaluate_claim(c, base, claims.min_seeds) for c in claims.claims]
    lines = [
        f"# {claims.title}",
        "",
        f"Generated by `promptfcl claims {source}` from the committed study summaries and run directories — do not "
        "edit by hand. Difference = the advantage of the paper's better cell over the cell it beats (better − "
        "worse; worse − better where lower is better), per seed, its mean and 95 % Student-t interval, beside the "
        f"paper's own difference (paper Δ). A verdict needs ≥ {claims.min_seeds} paired seeds that ran the same "
        "scenario from one clean code version and on which both cells pass the validity gate; a seed where either "
        "run fails the gate is left out of the verdict, named, and put back in a sensitivity check. Controls: "
        f"intervals on their valid seeds only; {ROLE_EXPECTED}. Mechanisms: {RUN_LEVEL_RULE}.",
        "",
        "Statuses:",
        "",
        *[f"- **{name}**: {meaning}." for name, meaning in STATUSES.items()],
        "",
        "| claim | paper | cells (better vs worse) | metric | paper Δ | our Δ [95 % CI] | seeds favouring | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        c, d = r["claim"], r["difference"]
        favour = f"{d.positive}/{d.n}" if d is not None else "–"
        paper = f"{c['paper_delta']:+.2f}" if c.get("paper_delta") is not None else "–"
        lines.append(
            f"| {c['id']} | {c['paper']} | `{c['better']}` vs `{c['worse']}` | {c['metric']} | {paper} | "
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
        if r.get("all_seeds") is not None:
            lines.append(f"With the seeds that failed the gate put back ({', '.join(map(str, r['excluded']))}): "
                         f"{_fmt_diff(r['all_seeds'])}, {r['all_seeds'].positive}/{r['all_seeds'].n} seeds favouring "
                         f"`{c['better']}`.")  # fmt: skip
        if r.get("reason"):
            lines.append(f"{r['status'].capitalize()} because: {r['reason'].rstrip('.')}.")
        prov = r.get("provenance")
        if prov:
            code = prov.get("code") or {}
            commits = "; ".join(f"`{k}` (code `{code.get(k, k)}`): {len(v)} run(s)" for k, v in prov["commits"].items())
            dirty = f"; with uncommitted changes: {', '.join(prov['dirty'])}" if prov["dirty"] else ""
            lines.append(f"Provenance: {commits}{dirty}.")
            if c.get("provenance_note"):
                lines.append(f"Provenance note: {c['provenance_note'].strip()}")
        for cell, checks in (r.get("mechanisms") or {}).items():
            for name, v in checks.items():
                lines.append(f"- `{cell}` {name}: **{v['verdict']}** {_mechanism_evidence(v)}.")
        for cell, seeds in r["failed"].items():
            for seed, checks in seeds.items():
                lines.append(f"- `{cell}` seed {seed} failed the validity gate: {', '.join(checks)}.")
        for item in r.get("controls") or []:
            if item.get("expected") and item["metric"] == c["metric"]:
                seeds = ", ".join(str(s) for s in sorted(item["expected"]))
                names = sorted({n for f in item["expected"].values() for n in f})
                lines.append(f"- control `{item['control'].cell}` seeds {seeds}: {', '.join(names)} failed, "
                             f"{EXPECTED_BECAUSE[item['control'].role or 'ablation']} (counted valid).")  # fmt: skip
        if r.get("controls"):
            lines += ["", *_controls_table(c, r)]
        if c.get("finding"):
            more = f" ([long form]({diagnoses}#{c['id']}))" if diagnoses and c.get("diagnosis") else ""
            lines += ["", f"Finding: {c['finding'].strip()}{more}"]
        elif c.get("diagnosis") and diagnoses:
            lines += ["", f"Diagnosis: [long form]({diagnoses}#{c['id']})."]
        lines.append("")
    return "\n".join(lines)


def diagnoses_markdown(claims: ClaimsFile, source: str) -> str:
    """The long form of every claim's diagnosis, one section per claim (linked from the claims page)."""
    lines = [f"# {claims.title}: diagnoses", "", f"Long forms of the findings in the claims page (`{source}`).", ""]
    for c in claims.claims:
        if c.diagnosis:
            lines += [f"## {c.id}", "", c.diagnosis.strip(), ""]
    return "\n".join(lines)


def write_claims(path: str | Path, out: str | Path) -> str:
    """Write the claims page to `out` and the long diagnoses beside it (`<out stem>_diagnoses.md`)."""
    claims, base = load_claims(path)
    out = Path(out)
    long_form = out.with_name(out.stem + "_diagnoses.md")
    text = claims_markdown(claims, base, str(path), long_form.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    long_form.write_text(diagnoses_markdown(claims, str(path)))
    return text
