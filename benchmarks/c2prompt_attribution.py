"""Why C2Prompt trails Fed-CODAP and Powder in the CPU evidence study: which of its two components costs accuracy,
and how.

Reads finished runs only (no training): the evidence study's `c2prompt`, `fedcodap` and `powder` cells and the
asynchronous controls study's `c2prompt`, `c2prompt_no_lcdc` (CPA only) and `c2prompt_no_cpa` (LCDC only) cells
(`benchmarks/evidence_controls_async.yaml`), on the seeds the controls have. Per run: `acc` (the claim's metric),
the mean accuracy of the (client, task) slots right after each was learned (the validity gate's `learned_tasks`),
and, where the run logged them, the round means of the CE on the samples that carried their label's compensation
prompt and on the plain ones (`lcdc_ce_compensated`, `lcdc_ce_plain`). It also checks that the controls study's
`c2prompt` run equals the evidence study's (same config and seed: same numbers, so the ablations are paired).

    python benchmarks/c2prompt_attribution.py --out benchmarks/results/c2prompt_attribution.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

EVIDENCE = Path("benchmarks/results/evidence_cpu")
PEERS = Path("benchmarks/results/evidence_peers")
CONTROLS = Path("benchmarks/results/evidence_controls_async")
CELLS = {
    "c2prompt": EVIDENCE / "c2prompt",
    "fedcodap": EVIDENCE / "fedcodap",
    "powder": PEERS / "powder",
    "c2prompt (controls study)": CONTROLS / "c2prompt",
    "cpa only (no LCDC)": CONTROLS / "c2prompt_no_lcdc",
    "lcdc only (no CPA)": CONTROLS / "c2prompt_no_cpa",
}


def run_row(run: Path) -> dict:
    m = json.loads((run / "metrics.json").read_text())
    learned = next(c for c in m["validity"]["checks"] if c["name"] == "learned_tasks")
    right_after = [float(x.split("/")[0]) for x in learned["detail"].split(", ")]
    rounds = [json.loads(x) for x in (run / "rounds.jsonl").read_text().splitlines() if x.strip()]
    row = {"acc": m["summary"]["acc"], "right_after": statistics.mean(right_after), "valid": m["validity"]["valid"]}
    for key in ("lcdc_ce_compensated", "lcdc_ce_plain"):
        values = [r[key] for r in rounds if key in r]
        if values:
            row[key] = statistics.mean(values)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/c2prompt_attribution.json")
    args = ap.parse_args()
    seeds = sorted(int(p.name[4:]) for p in (CONTROLS / "c2prompt_no_lcdc").glob("seed[0-9]") if p.is_dir())
    table = {
        cell: {s: run_row(d / f"seed{s}") for s in seeds if (d / f"seed{s}" / "metrics.json").is_file()}
        for cell, d in CELLS.items()
    }
    same = all(
        table["c2prompt (controls study)"][s]["acc"] == table["c2prompt"][s]["acc"]
        for s in table["c2prompt (controls study)"]
    )
    base = table["c2prompt"]
    print(f"seeds {seeds}; controls' c2prompt equals the evidence run: {same}")
    print(f"{'cell':28} {'acc':>7} {'minus C2Prompt':>15} {'right after':>12} {'CE comp.':>9} {'CE plain':>9}")
    summary = {}
    for cell, rows in table.items():
        if not rows:
            continue
        mean = {k: statistics.mean(r[k] for r in rows.values()) for k in next(iter(rows.values())) if k != "valid"}
        mean["minus_c2prompt"] = statistics.mean(rows[s]["acc"] - base[s]["acc"] for s in rows)
        summary[cell] = mean
        ce = [f"{mean[k]:9.3f}" if k in mean else f"{'-':>9}" for k in ("lcdc_ce_compensated", "lcdc_ce_plain")]
        print(
            f"{cell:28} {mean['acc']:7.2f} {mean['minus_c2prompt']:+15.2f} {mean['right_after']:12.2f} {' '.join(ce)}"
        )
    Path(args.out).write_text(
        json.dumps(
            {"seeds": seeds, "controls_c2prompt_equals_evidence": same, "mean": summary, "runs": table}, indent=2
        )
    )


if __name__ == "__main__":
    main()
