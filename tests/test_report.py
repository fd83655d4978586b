"""`promptfcl compare` / `promptfcl report`: the comparison table (seeds averaged, extra summary keys as columns),
plots embedded in a self-contained HTML copy, and every run's exact config and environment (git commit)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest

from promptfcl.cli import main
from promptfcl.config import build_config
from promptfcl.environment import environment_info
from promptfcl.experiment import Experiment

from .conftest import tiny_raw


def tiny_run(path: Path, seed: int, method: str = "fedavg_prompt") -> dict:
    raw = tiny_raw(seed=seed, name=f"tiny_{method}", scenario={"num_tasks": 2, "rounds_per_task": 1})
    raw["method"] = {"name": method, "local_epochs": 1, "batch_size": 8}
    if method == "fedavg_prompt":
        raw["method"]["layers"] = [0, 1]
    return Experiment(build_config(raw), path, show_progress=False).run()


def test_environment_records_the_git_commit(tmp_path) -> None:
    repo = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=False)
    env = environment_info()
    if head.returncode == 0:
        assert env["git"]["commit"] == head.stdout.strip() and isinstance(env["git"]["dirty"], bool)
    else:  # an installed copy: no commit to record, and it says so
        assert env["git"]["commit"] is None and "not in a git checkout" in env["git"]["note"]
    assert env["packages"]["torch"] and env["packages"]["timm"]


@pytest.mark.slow
def test_compare_writes_table_plots_html_and_provenance(tmp_path) -> None:
    metrics = [tiny_run(tmp_path / f"a{s}", s) for s in (0, 1)] + [tiny_run(tmp_path / "b0", 0, "fedvit")]
    # a regime with extra summary keys (e.g. long-tailed head/mid/tail) shows up as columns, generically
    m = json.loads((tmp_path / "b0" / "metrics.json").read_text())
    m["summary"]["tail_accuracy"] = 12.5
    m["summary"]["kr"] = {"local": 40.0}
    (tmp_path / "b0" / "metrics.json").write_text(json.dumps(m))
    out = tmp_path / "cmp"
    assert main(["compare", str(tmp_path / "a0"), str(tmp_path / "a1"), str(tmp_path / "b0"), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| cell"))
    for col in ("final avg acc (%)", "forgetting (pts)", "BWT (pts)", "tail_accuracy", "kr.local", "comm / round (MB)",
                "wall time (s)", "valid seeds"):  # fmt: skip
        assert f" {col} |" in header  # readable headers; keys without a label keep their name
    assert len([line for line in md.splitlines() if line.startswith("| cell | method |")]) == 1  # one scenario
    faa = [x["summary"]["faa"] for x in metrics[:2]]
    row = next(line for line in md.splitlines() if line.startswith("| tiny_fedavg_prompt ⚠ INVALID |"))
    assert f" | {statistics.fmean(faa):.2f} ± {statistics.stdev(faa):.2f} |" in row  # seeds averaged
    assert "| 0/2 (backbone_pretrained" in row  # random-init: flagged by the validity gate
    assert "| tiny_fedvit ⚠ INVALID | fedvit | 1 |" in md and "| 12.50 |" in md
    assert "### Validity" in md and "backbone_pretrained" in md
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert {"figures/accuracy_curves.png", "figures/accuracy_matrices.png", "figures/accuracy_vs_communication.png",
            "figures/scenario_0.png"} <= set(images)  # fmt: skip
    assert all((out / p).is_file() for p in images)
    html = (out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == len(images) and 'src="figures' not in html
    assert "<table>" in html and "tail_accuracy" in html
    appendix = (out / "report_configs.md").read_text()  # the configs and environments, linked from the report
    assert "[report_configs.md](report_configs.md)" in md and '<a href="report_configs.md">' in html
    commit = environment_info()["git"]["commit"]
    if commit:
        assert commit[:12] in md and f'"commit": "{commit}"' in appendix  # every run's environment, verbatim
    assert "name: tiny_fedvit" in appendix and "seed: 1" in appendix  # every run's exact config
    assert "name: tiny_fedvit" not in md and "<pre>" not in html
    assert "RANDOM INIT" in md  # the tiny runs have no pretrained weights, and the report says so


def test_report_refuses_a_folder_that_is_not_a_study(tmp_path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "not a study directory" in " ".join(capsys.readouterr().err.split())  # rich wraps long paths
    assert main(["compare", str(tmp_path)]) == 2
    assert "no finished run" in " ".join(capsys.readouterr().err.split())


def test_long_tailed_class_groups_become_the_first_columns(tmp_path) -> None:
    from promptfcl.report.collect import Group, RunResult, aggregate

    def run(seed: int, tail: float) -> RunResult:
        summary = {"faa": 50.0, "average_forgetting": 0.0, "bwt": 0.0,
                   "class_groups": {"overall": 50.0, "head": 70.0, "mid": 40.0, "tail": tail}}  # fmt: skip
        metrics = {"method": "capt", "seed": seed, "summary": summary,
                   "communication": {"mb_per_round": 1.0}, "timing": {"total_seconds": 2.0}}  # fmt: skip
        return RunResult(tmp_path, metrics, {"seed": seed}, "", {})

    rows, columns = aggregate([Group("capt", [run(0, 10.0), run(1, 20.0)])])
    assert columns[:5] == ["overall (%)", "head (%)", "mid (%)", "tail (%)", "FAA (%)"]
    assert "forgetting (%)" not in columns and "BWT (%)" not in columns  # one task: not defined
    assert rows[0]["values"]["tail (%)"] == pytest.approx((15.0, statistics.stdev([10.0, 20.0])))


def test_scenario_labels_name_each_scenario_family() -> None:
    from promptfcl.report.comparison import scenario_label

    data = {"name": "cifar100"}
    asyn = {
        "kind": "asynchronous", "num_tasks": 5, "num_clients": 5, "rounds_per_task": 3,
        "partition": {"kind": "dirichlet", "beta": 0.5}, "asynchronous": {"min_overlap": 0, "data_slices": 5},
    }  # fmt: skip
    label = scenario_label({"scenario": asyn, "data": data})
    assert "asynchronous task switching" in label and "Dirichlet" not in label
    personal = {"mode": "asynchronous", "private_classes": 15, "public_classes": 25, "beta": 1.0}
    pers = {**asyn, "kind": "personalized", "personalized": personal}
    assert "personalized asynchronous (15 private + 25 public classes" in scenario_label(
        {"scenario": pers, "data": data}
    )
    cil = {**asyn, "kind": "class_incremental"}
    assert "Dirichlet β=0.5" in scenario_label({"scenario": cil, "data": data})
