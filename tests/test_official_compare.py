"""benchmarks/official_compare.py: the paired promptfcl − official table reads both sides' files correctly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def compare():
    return load_benchmark("official_compare")


def write_ours(
    root: Path, seed: int, faa: float, client_cpu: list[float], eval_cpu: list[float], cell: str = "lorm"
) -> None:
    run = root / cell / f"seed{seed}"
    run.mkdir(parents=True)
    matrix = [[faa + 10], [faa - 5, faa + 5]]  # last row's mean = faa
    (run / "metrics.json").write_text(json.dumps({"summary": {"faa": faa}, "accuracy_matrix": matrix}))
    rounds = [{"client_cpu_seconds": c, "server_cpu_seconds": 1.0, "eval_cpu_seconds": e}
              for c, e in zip(client_cpu, eval_cpu, strict=True)]  # fmt: skip
    (run / "rounds.jsonl").write_text("\n".join(json.dumps(r) for r in rounds) + "\n")


def write_theirs(root: Path, seed: int, faa: float, client_cpu: float, evals: int) -> None:
    cell = root / "lorm"
    cell.mkdir(parents=True, exist_ok=True)
    rounds = [{"client_cpu_seconds": client_cpu, "server_cpu_seconds": 2.0, "eval_cpu_seconds": 3.0 * evals,
               "evaluations": evals, "loss": 1.0}] * 2  # fmt: skip
    (cell / f"seed{seed}.json").write_text(
        json.dumps({"faa": faa, "accuracy_matrix": [[faa], [faa, faa]], "rounds": rounds})
    )


def test_paired_difference_and_cpu_ratios(compare, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for seed, (a, b) in enumerate([(50.0, 49.0), (52.0, 50.5), (51.0, 50.5)]):
        write_ours(ours, seed, a, [4.0, 6.0], [0.0, 2.0])  # one evaluation of 2 s in two rounds
        write_theirs(theirs, seed, b, 10.0, evals=2)  # two evaluations of 3 s each per round
    write_theirs(theirs, 7, 40.0, 10.0, evals=1)  # a seed promptfcl did not run: left out of the pairs
    text = compare.main(["--promptfcl", str(ours), "--official", str(theirs)])
    assert "over 3 paired seeds: +1.00 [-0.24, +2.24]" in text  # differences +1, +1.5, +0.5
    assert "| 1 | 52.00 | 50.50 | +1.50 | 15.00 | 0.00 |" in text  # forgetting: 60 − 45 on ours, none on theirs
    assert "needs a measured cause" not in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if "CPU" not in line and "per " in line}
    assert rows["client per round"].split("|")[2:5] == [" 5.00 ", " 10.00 ", " 0.50 "]
    assert rows["server per round"].split("|")[2:5] == [" 1.00 ", " 2.00 ", " 0.50 "]
    assert rows["eval per evaluation"].split("|")[2:5] == [" 2.00 ", " 3.00 ", " 0.67 "]


def test_an_interval_outside_the_tolerance_is_flagged(compare, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for seed, (a, b) in enumerate([(50.0, 40.0), (52.0, 41.0), (51.0, 40.5)]):
        write_ours(ours, seed, a, [4.0], [1.0])
        write_theirs(theirs, seed, b, 10.0, evals=1)
    assert "needs a measured cause" in compare.main(["--promptfcl", str(ours), "--official", str(theirs)])


def test_an_official_file_without_the_phase_times_is_refused(compare, tmp_path: Path) -> None:
    cell = tmp_path / "theirs" / "lorm"
    cell.mkdir(parents=True)
    (cell / "seed0.json").write_text(json.dumps({"faa": 1.0, "accuracy_matrix": [[1.0]], "rounds": [{}]}))
    with pytest.raises(SystemExit, match="client_cpu_seconds"):
        compare.main(["--promptfcl", str(tmp_path / "ours"), "--official", str(tmp_path / "theirs")])


def test_a_single_paired_seed_gives_its_difference_without_an_interval(compare, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write_ours(ours, 0, 48.82, [4.0], [1.0])
    write_theirs(theirs, 0, 49.0, 10.0, evals=1)
    text = compare.main(["--promptfcl", str(ours), "--official", str(theirs)])
    assert "over 1 paired seeds: -0.18 (one seed: no interval)" in text
    assert "| 0 | 48.82 | 49.00 | -0.18 |" in text


def test_the_rerun_control_pairs_a_cell_with_its_other_training_seed(compare, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for seed, (a, b, again) in enumerate([(50.0, 49.0, 47.0), (52.0, 50.5, 53.0), (51.0, 50.5, 51.0)]):
        write_ours(ours, seed, a, [4.0], [1.0])
        write_theirs(theirs, seed, b, 10.0, evals=1)
        write_ours(ours, seed, again, [4.0], [1.0], cell="lorm_rerun")
    text = compare.main(["--promptfcl", str(ours), "--official", str(theirs), "--rerun", "lorm=lorm_rerun"])
    # lorm − lorm_rerun: +3, −1, 0 → mean +0.67, sd 2.08; lorm − official: +1, +1.5, +0.5 → sd 0.50
    assert "lorm − lorm_rerun (the same scenarios, other training randomness) over 3 paired seeds: +0.67" in text
    assert "0: 47.00 (+3.00), 1: 53.00 (-1.00), 2: 51.00 (+0.00)" in text
    assert "promptfcl − official 0.50, lorm − lorm_rerun 2.08." in text
    with pytest.raises(SystemExit, match="CELL=OTHER"):
        compare.main(["--promptfcl", str(ours), "--official", str(theirs), "--rerun", "lorm"])


def test_timing_seeds_restrict_the_cpu_rows_only(compare, tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for seed, client in enumerate([10.0, 10.0, 40.0]):  # seed 2's two sides ran in other sessions
        write_ours(ours, seed, 50.0 + seed, [5.0 if seed < 2 else 20.0], [1.0])
        write_theirs(theirs, seed, 50.0, client, evals=1)
    text = compare.main(["--promptfcl", str(ours), "--official", str(theirs), "--timing-seeds", "0,1"])
    assert "over 3 paired seeds: +1.00" in text  # accuracy still pairs every seed
    assert "CPU seconds over seeds 0, 1" in text
    row = next(line for line in text.splitlines() if line.startswith("| client per round"))
    assert row.split("|")[2:5] == [" 5.00 ", " 10.00 ", " 0.50 "]
