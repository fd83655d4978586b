"""Side-by-side table: promptfcl against an official code on the same exported scenarios (docs/official.md).

    python benchmarks/official_compare.py --promptfcl benchmarks/results/official_side_by_side \
        --official benchmarks/results/official_side_by_side/official [--out table.md]

`--promptfcl` is the study directory of `benchmarks/official_side_by_side.yaml` (`<cell>/seed<k>/metrics.json` and
`rounds.jsonl`). `--official` holds one JSON file per official run, `<cell>/seed<k>.json`, written by whatever
launched the official code, with:

- `faa`: the final average accuracy (%), the mean of the last accuracy-matrix row;
- `accuracy_matrix`: row t = the accuracies (%) of tasks 0..t after task t;
- `rounds`: one entry per communication round, in order, each with `client_cpu_seconds`, `server_cpu_seconds`,
  `eval_cpu_seconds` (process CPU seconds of that phase), `evaluations` (how many evaluations the eval seconds
  cover) and `loss` (the clients' mean training loss, or null).

`--rerun CELL=OTHER` names a promptfcl cell that re-runs CELL on the same scenarios with other training randomness
(`train_seed`): the table then also gives the paired CELL − OTHER difference, the spread two runs of one code show,
and the standard deviations of both sets of differences — the yardstick for whether promptfcl and the official code
differ by more than run-to-run noise.

`--timing-seeds 0,1,2,3` restricts the CPU-seconds rows to those seeds, for when some seeds' two sides were timed in
different sessions (CPU time depends on the machine and its load, so only pairs timed side by side compare).

Per cell it prints the per-seed FAA on both sides, the paired promptfcl − official difference with its 95 % t
interval (flagged when the interval leaves ± 3 points), forgetting, and CPU seconds per round for the client,
server and evaluation phases on both sides (evaluation per evaluation, since the two loops may evaluate a different
number of times), with promptfcl / official ratios. Nothing is run: the table reads finished runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from promptfcl.evaluation.metrics import average_forgetting
from promptfcl.statistics.paired import PairedDifference, paired_difference

PHASES = ("client", "server", "eval")
TOLERANCE = 3.0  # points: a paired interval leaving ± this needs a measured cause (docs/official.md)


def promptfcl_run(run: Path) -> dict[str, Any]:
    """FAA, accuracy matrix and per-round phase CPU seconds of one promptfcl run directory."""
    metrics = json.loads((run / "metrics.json").read_text())
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line.strip()]
    return {
        "faa": float(metrics["summary"]["faa"]),
        "accuracy_matrix": metrics["accuracy_matrix"],
        "rounds": [
            {
                **{f"{p}_cpu_seconds": float(r.get(f"{p}_cpu_seconds") or 0.0) for p in PHASES},
                "evaluations": 1 if r.get("eval_cpu_seconds") else 0,
            }
            for r in rounds
        ],
    }


def study_cell(cell_dir: Path) -> dict[int, dict[str, Any]]:
    """The finished promptfcl runs of one study cell, by seed."""
    return {
        int(d.name[4:]): promptfcl_run(d)
        for d in sorted(cell_dir.glob("seed*"))
        if d.is_dir() and d.name[4:].isdigit() and (d / "metrics.json").is_file()
    }


def official_run(path: Path) -> dict[str, Any]:
    """An official run's result file, checked for the fields the table reads."""
    data = json.loads(path.read_text())
    missing = [k for k in ("faa", "accuracy_matrix", "rounds") if k not in data]
    if missing:
        raise SystemExit(f"{path}: missing {', '.join(missing)} (see this script's docstring for the format)")
    for i, r in enumerate(data["rounds"]):
        absent = [f"{p}_cpu_seconds" for p in PHASES if f"{p}_cpu_seconds" not in r]
        if absent:
            raise SystemExit(f"{path}: round {i} lacks {', '.join(absent)}")
    return data


def per_round(runs: list[dict[str, Any]], phase: str) -> float:
    """Mean CPU seconds of `phase` per round (per evaluation for "eval") over all rounds of all runs."""
    if phase == "eval":
        total = sum(r["eval_cpu_seconds"] for run in runs for r in run["rounds"])
        count = sum(int(r.get("evaluations", 0)) for run in runs for r in run["rounds"])
        return total / count if count else float("nan")
    values = [r[f"{phase}_cpu_seconds"] for run in runs for r in run["rounds"]]
    return statistics.fmean(values) if values else float("nan")


def rerun_lines(
    cell: str, other: str, ours: dict[int, dict[str, Any]], rerun: dict[int, dict[str, Any]], versus: PairedDifference
) -> list[str]:
    """The run-to-run control: CELL − OTHER (same scenarios, other training seed) beside promptfcl − official."""
    seeds = sorted(set(ours) & set(rerun))
    if len(seeds) < 2:
        return [f"Run-to-run control ({cell} − {other}): fewer than 2 seeds finished on both.", ""]
    ctrl = paired_difference({s: ours[s]["faa"] for s in seeds}, {s: rerun[s]["faa"] for s in seeds})
    per_seed = ", ".join(f"{s}: {rerun[s]['faa']:.2f} ({d:+.2f})" for s, d in zip(seeds, ctrl.differences, strict=True))
    sd = statistics.stdev(versus.differences) if versus.n > 1 else float("nan")
    return [
        f"Run-to-run control, {cell} − {other} (the same scenarios, other training randomness) over {ctrl.n} "
        f"paired seeds: {ctrl.mean:+.2f} [{ctrl.low:+.2f}, {ctrl.high:+.2f}]; {other} FAA (difference) per seed: "
        f"{per_seed}.",
        f"Standard deviation of the per-seed differences: promptfcl − official {sd:.2f}, "
        f"{cell} − {other} {statistics.stdev(ctrl.differences):.2f}.",
        "",
    ]


def compare_cell(
    cell: str,
    ours: dict[int, dict[str, Any]],
    theirs: dict[int, dict[str, Any]],
    rerun: tuple[str, dict[int, dict[str, Any]]] | None = None,
    timing_seeds: set[int] | None = None,
) -> str:
    """One cell's Markdown section (seeds both sides finished), with the run-to-run control when `rerun` names
    the cell re-run with other training randomness and its runs."""
    seeds = sorted(set(ours) & set(theirs))
    if not seeds:
        return f"### {cell}\n\nNo seed finished on both sides.\n"
    a, b = {s: ours[s]["faa"] for s in seeds}, {s: theirs[s]["faa"] for s in seeds}
    if len(seeds) > 1:
        diff = paired_difference(a, b)
    else:  # one pair: its difference, no interval
        d = a[seeds[0]] - b[seeds[0]]
        diff = PairedDifference(seeds, [d], d, d, d, int(d > 0))
    lines = [f"### {cell}", "", "| seed | promptfcl FAA | official FAA | difference | promptfcl forgetting | "
             "official forgetting |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for s in seeds:
        a, b = ours[s], theirs[s]
        lines.append(
            f"| {s} | {a['faa']:.2f} | {b['faa']:.2f} | {a['faa'] - b['faa']:+.2f} | "
            f"{average_forgetting(a['accuracy_matrix']):.2f} | {average_forgetting(b['accuracy_matrix']):.2f} |"
        )
    outside = diff.n > 1 and (diff.low < -TOLERANCE or diff.high > TOLERANCE)
    interval = f"[{diff.low:+.2f}, {diff.high:+.2f}]" if diff.n > 1 else "(one seed: no interval)"
    lines += ["", f"promptfcl − official FAA over {diff.n} paired seeds: {diff.mean:+.2f} {interval}"
              + (f" — leaves ± {TOLERANCE:g} points: needs a measured cause" if outside else ""), ""]  # fmt: skip
    if rerun is not None:
        lines += rerun_lines(cell, rerun[0], ours, rerun[1], diff)
    timed = [s for s in seeds if timing_seeds is None or s in timing_seeds]
    if timing_seeds is not None:
        lines += [f"CPU seconds over seeds {', '.join(map(str, timed))} (both sides timed in one session):", ""]
    lines += ["| CPU seconds | promptfcl | official | promptfcl / official |", "| --- | --- | --- | --- |"]
    for phase in PHASES:
        a, b = per_round([ours[s] for s in timed], phase), per_round([theirs[s] for s in timed], phase)
        label = "per evaluation" if phase == "eval" else "per round"
        lines.append(f"| {phase} {label} | {a:.2f} | {b:.2f} | {a / b if b else float('nan'):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--promptfcl", type=Path, required=True, help="study directory of official_side_by_side.yaml")
    ap.add_argument("--official", type=Path, required=True, help="<cell>/seed<k>.json of the official runs")
    ap.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    ap.add_argument(
        "--rerun",
        action="append",
        default=[],
        metavar="CELL=OTHER",
        help="promptfcl cell OTHER re-runs CELL with other training randomness: add the run-to-run control",
    )
    ap.add_argument("--timing-seeds", help="comma-separated seeds whose CPU seconds are compared (default: all)")
    args = ap.parse_args(argv)
    try:
        timing = {int(x) for x in args.timing_seeds.split(",")} if args.timing_seeds else None
    except ValueError:
        raise SystemExit(f"--timing-seeds {args.timing_seeds!r}: give comma-separated integers, e.g. 0,1,2") from None
    reruns = dict(item.split("=", 1) for item in args.rerun if "=" in item)
    if len(reruns) != len(args.rerun):
        raise SystemExit("--rerun takes CELL=OTHER, e.g. --rerun hepco=hepco_train_seed")
    sections = []
    for cell_dir in sorted(p for p in args.official.iterdir() if p.is_dir()):
        theirs = {int(f.stem[4:]): official_run(f) for f in sorted(cell_dir.glob("seed*.json"))}
        ours = study_cell(args.promptfcl / cell_dir.name)
        other = reruns.get(cell_dir.name)
        rerun = (other, study_cell(args.promptfcl / other)) if other else None
        sections.append(compare_cell(cell_dir.name, ours, theirs, rerun, timing))
    text = "\n".join(sections) if sections else f"no official results under {args.official}\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
