"""Comparison reports split by scenario family, with readable column headers and the configs in an appendix.

Fake run directories (config.yaml + metrics.json, nothing trained) stand in for a study: class-incremental cells
(Dirichlet β = 0.05) and personalized cells must land in separate tables and separate figures, each table with
only the columns its runs report; summary.json keeps its raw column names and row keys for the tools that read it.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from promptfcl.report import comparison
from promptfcl.report.collect import groups_from_study
from promptfcl.report.comparison import APPENDIX, write_report
from promptfcl.report.families import family_label, group_families, scenario_identity
from promptfcl.report.labels import column_label, column_notes, label

DATA = {"name": "cifar100", "root": "/data/cifar-100-python", "train_per_class": 100, "test_per_class": 20}
CIL = {
    "kind": "class_incremental", "num_tasks": 2, "classes_per_task": 10, "num_clients": 5, "rounds_per_task": 2,
    "partition": {"kind": "dirichlet", "beta": 0.05, "min_samples": 4},
}  # fmt: skip
PERSONALIZED = {
    "kind": "personalized", "num_tasks": 2, "num_clients": 5, "rounds_per_task": 2,
    "personalized": {"mode": "asynchronous", "private_classes": 15, "public_classes": 25, "beta": 1.0},
}  # fmt: skip
CIL_SUMMARY = {"faa": 54.0, "average_forgetting": 12.0, "bwt": -12.0, "sample_weighted_accuracy": 55.0}
PERSONAL_SUMMARY = {**CIL_SUMMARY, "kr_t": 96.0, "kr_s": 99.0, "task_accuracy": {"1": 64.0, "2": 70.0}}
CELLS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # cell -> (scenario, summary); HGP and FedL2P interleaved
    "hgp": (CIL, CIL_SUMMARY),
    "fedl2p": (PERSONALIZED, PERSONAL_SUMMARY),
    "lorm": (CIL, CIL_SUMMARY),
    "fedmgp": (PERSONALIZED, PERSONAL_SUMMARY),
}
CLASS_INCREMENTAL, PERSONAL = {"hgp", "lorm"}, {"fedl2p", "fedmgp"}


def fake_run(run_dir: Path, cell: str, seed: int, scenario: dict[str, Any], summary: dict[str, Any]) -> Path:
    """A finished run as `promptfcl run` leaves it, as far as the report reads it."""
    run_dir.mkdir(parents=True)
    cfg = {
        "name": f"fake_{cell}", "seed": seed, "data": DATA, "scenario": scenario, "method": {"name": cell},
        "backbone": {"name": "vit_tiny", "img_size": 32, "weights": "/assets/vit_tiny.safetensors"},
    }  # fmt: skip
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    checks = [{"name": "client_loss", "value": 0.2 + seed / 10, "passed": True, "threshold": "", "detail": ""}]
    if cell in PERSONAL:
        checks.append({"name": "key_hit", "value": 13.0, "passed": True, "threshold": "", "detail": ""})
    metrics = {
        "method": cell, "run": cfg["name"], "seed": seed, "summary": copy.deepcopy(summary),
        "accuracy_curve": [70.0, 60.0 + seed], "accuracy_matrix": [[70.0], [50.0, 70.0 + seed]],
        "communication": {"bytes_up": 2e6, "bytes_down": 1e6, "rounds": 4, "mb_per_round": 0.75},
        "timing": {"total_seconds": 30.0 + seed}, "validity": {"valid": True, "checks": checks},
    }  # fmt: skip
    (run_dir / "metrics.json").write_text(json.dumps(metrics))
    (run_dir / "environment.json").write_text(json.dumps({"git": {"commit": "a" * 40, "dirty": False}}))
    return run_dir


def fake_study(out: Path, cells: dict[str, tuple[dict[str, Any], dict[str, Any]]] = CELLS) -> Path:
    """A study directory: study.json (the plan) and two seeds of every cell."""
    seeds = [0, 1]
    for cell, (scenario, summary) in cells.items():
        for seed in seeds:
            fake_run(out / cell / f"seed{seed}", cell, seed, scenario, summary)
    plan = {"study": "fake", "seeds": seeds, "cells": [{"name": c, "source": c, "sweep": {}} for c in cells]}
    (out / "study.json").write_text(json.dumps({**plan, "direct_cell": None}))
    return out


def tables(md: str) -> list[tuple[list[str], list[str]]]:
    """Every comparison table of a report: (header cells, row names)."""
    out = []
    for block in md.split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith("| cell | method |"):
            header = [c.strip() for c in lines[0].strip("|").split("|")]
            out.append((header, [line.split("|")[1].strip() for line in lines[2:]]))
    return out


def sections(md: str) -> list[str]:
    """The report split at its level-2 headings."""
    return re.split(r"\n(?=## )", md)


def test_each_scenario_family_gets_its_own_table_with_only_its_columns(tmp_path) -> None:
    out = fake_study(tmp_path / "study")
    write_report(groups_from_study(out), out, "Study fake")
    md = (out / "report.md").read_text()
    (ci_header, ci_rows), (pers_header, pers_rows) = tables(md)
    assert set(ci_rows) == CLASS_INCREMENTAL and set(pers_rows) == PERSONAL  # never one table for both
    for header in (ci_header, pers_header):
        assert header[:4] == ["cell", "method", "seeds", "valid seeds"]
        assert {"final avg acc (%)", "forgetting (pts)", "BWT (pts)", "comm / round (MB)", "wall time (s)"} <= set(
            header
        )
    assert {"KR_t (%)", "KR_s (%)", "task 1 acc (%)", "task 2 acc (%)"} <= set(pers_header)
    assert not {"KR_t (%)", "KR_s (%)", "task 1 acc (%)"} & set(ci_header)  # only the columns its runs have
    assert "kr_t" not in md and "task_accuracy.1" not in md and "FAA (%)" not in md  # no raw keys shown
    # each family is named from its config, in the order of its first cell
    assert "## 1. class-incremental, Dirichlet β = 0.05, 2 tasks × 10 classes, 5 clients; cifar100, 100/20" in md
    assert "## 2. personalized asynchronous, 15 private + 25 public classes, Dirichlet β = 1, 2 tasks per client" in md
    # the validity table is split the same way: the personalized check is not a column of the class-incremental one
    validity = [s for s in re.split(r"\n(?=### )", md) if s.startswith("### Validity")]
    assert len(validity) == 2
    assert "key_hit" not in validity[0] and "| hgp | 0.25 |" in validity[0]  # mean over seeds 0.2, 0.3
    assert "| fedmgp | 0.25 | 13 | all pass |" in validity[1]
    assert md.count("Validity gate (`promptfcl/evaluation/validity.py`") == 1  # explained once
    # the column definitions: every header explained once, the personalized ones in its own section
    ci_section, pers_section = sections(md)[1:3]
    assert "final avg acc (%): average accuracy" in ci_section and "KR_t (%)" not in ci_section
    assert "KR_t (%): temporal retention" in pers_section and "task k acc (%):" in pers_section
    assert "final avg acc (%): average accuracy" not in pers_section


def test_a_personalized_cell_never_shares_a_figure_with_a_class_incremental_one(tmp_path, monkeypatch) -> None:
    plotted: dict[str, set[str]] = {}

    def recording(plot):  # noqa: ANN001, ANN202
        def wrapped(data: dict[str, Any], path: Path, *args: Any) -> None:
            plotted[path.name] = set(data)
            plot(data, path, *args)

        return wrapped

    for name in ("plot_mean_accuracy_curves", "plot_accuracy_matrices", "plot_accuracy_vs_communication"):
        monkeypatch.setattr(comparison, name, recording(getattr(comparison, name)))
    out = fake_study(tmp_path / "study")
    write_report(groups_from_study(out), out, "Study fake")
    assert set(plotted) == {
        f"family{k}_{plot}.png"
        for k in (1, 2)
        for plot in ("accuracy_curves", "accuracy_matrices", "accuracy_vs_communication")
    }
    for name, cells in plotted.items():
        assert cells == (CLASS_INCREMENTAL if name.startswith("family1_") else PERSONAL), name
    md = (out / "report.md").read_text()
    ci_section, pers_section = sections(md)[1:3]
    assert "figures/family1_accuracy_curves.png" in ci_section and "family2_" not in ci_section
    assert "figures/family2_accuracy_curves.png" in pers_section and "family1_" not in pers_section
    html = (out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == len(re.findall(r"!\[[^\]]*\]\(figures/", md)) == 6


def test_one_family_keeps_the_single_table_layout_and_plain_figure_names(tmp_path) -> None:
    out = fake_study(tmp_path / "study", {c: CELLS[c] for c in ("hgp", "lorm")})
    (out / "figures").mkdir()
    (out / "figures" / "family3_accuracy_curves.png").write_bytes(b"stale")  # an older report's figure
    (out / "figures" / "notes.png").write_bytes(b"not the report's")
    write_report(groups_from_study(out), out, "Study fake")
    md = (out / "report.md").read_text()
    assert len(tables(md)) == 1 and "## Comparison: class-incremental, Dirichlet β = 0.05" in md
    assert "scenario families" not in md and "## 1." not in md
    assert {"figures/accuracy_curves.png", "figures/accuracy_matrices.png"} <= set(re.findall(r"\]\(([^)]+)\)", md))
    assert not (out / "figures" / "family3_accuracy_curves.png").exists()  # stale figures of this report removed
    assert (out / "figures" / "notes.png").exists()  # other files left alone


def test_configs_move_to_an_appendix_linked_from_both_reports(tmp_path) -> None:
    out = fake_study(tmp_path / "study")
    write_report(groups_from_study(out), out, "Study fake")
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    appendix = (out / APPENDIX).read_text()
    for cell in CELLS:
        for seed in (0, 1):
            assert (out / cell / f"seed{seed}" / "config.yaml").read_text().strip() in appendix  # verbatim
            assert f"{cell} seed {seed}: {cell}/seed{seed} · git {'a' * 12}" in appendix
    assert "name: fake_hgp" not in md and "```yaml" not in md and "<pre>" not in html  # no dumps in the report
    assert f"[{APPENDIX}]({APPENDIX})" in md and f'<a href="{APPENDIX}">{APPENDIX}</a>' in html
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert [r for r in refs if not r.startswith("data:image/png;base64,")] == [APPENDIX]  # self-contained but that
    assert f"`{'a' * 12}` (8 runs)" in md  # the commits, counted
    assert "[report.md](report.md)" in appendix and appendix.index("## class-incremental") < appendix.index(
        "## personalized"
    )
    assert len(md.encode()) < len(appendix.encode())


def test_summary_json_keeps_its_raw_keys_and_the_report_leaves_it_alone(tmp_path) -> None:
    from promptfcl.study import summarize_study

    out = fake_study(tmp_path / "study")
    summarize_study(SimpleNamespace(name="fake"), out)  # type: ignore[arg-type]  # only the name is read
    before = (out / "summary.json").read_bytes(), (out / "summary.csv").read_bytes()
    summary = json.loads(before[0])
    assert set(summary) == {"study", "columns", "rows"}
    assert summary["columns"] == [
        "FAA (%)", "forgetting (%)", "BWT (%)", "kr_t", "kr_s", "task_accuracy.1", "task_accuracy.2", "MB / round",
        "wall time (s)",
    ]  # fmt: skip
    row = next(r for r in summary["rows"] if r["cell"] == "fedl2p")
    assert set(row) == {
        "cell",
        "method",
        "seeds",
        "sweep",
        "upper_bound",
        "values",
        "valid_seeds",
        "invalid",
        "per_seed",
    }
    assert row["values"]["FAA (%)"] == [54.0, 0.0] and row["values"]["kr_t"] == [96.0, 0.0]
    assert row["per_seed"]["0"]["faa"] == 54.0 and row["per_seed"]["1"]["task_accuracy.2"] == 70.0  # claims read these
    header = before[1].decode().splitlines()[0]
    assert header.startswith("cell,method,seeds,valid_seeds,FAA (%) mean,FAA (%) std,forgetting (%) mean")
    write_report(groups_from_study(out), out, "Study fake")
    assert ((out / "summary.json").read_bytes(), (out / "summary.csv").read_bytes()) == before


def test_promptfcl_report_regenerates_a_study_report_from_its_runs(tmp_path) -> None:
    from promptfcl.cli import main

    out = fake_study(tmp_path / "study")
    assert main(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert md.startswith("# Study fake") and len(tables(md)) == 2 and (out / APPENDIX).is_file()
    assert "4 rows, 8 finished runs in 2 scenario families" in md


# ---------------------------------------------------------------------------------------------- what a family is


def test_the_family_identity_ignores_seeds_paths_budgets_and_unused_sections() -> None:
    base = {"seed": 0, "data": DATA, "scenario": CIL}
    same = [
        {**base, "seed": 3, "name": "other"},
        {**base, "data": {**DATA, "root": "/elsewhere", "cache": False, "decode_workers": 2}},
        {**base, "scenario": {**CIL, "rounds_per_task": 1}},  # a zero-shot / probe reference row on the same tasks
        {**base, "scenario": {**CIL, "upper_bound": "joint"}},  # an upper bound belongs to its federated family
        {**base, "scenario": {**CIL, "partition": {**CIL["partition"], "category_ratio": 0.3}}},  # hepco-only
        {**base, "scenario": {**CIL, "personalized": {"beta": 9.0}, "domains": None}},  # another kind's section
        {**base, "scenario": {**CIL, "participation": {"fraction": 1.0}, "class_order": "natural"}},  # defaults
    ]
    for cfg in same:
        assert scenario_identity(cfg) == scenario_identity(base), cfg
    different = [
        {**base, "scenario": {**CIL, "partition": {"kind": "hepco"}}},
        {**base, "scenario": {**CIL, "partition": {**CIL["partition"], "beta": 0.5}}},
        {**base, "scenario": PERSONALIZED},
        {**base, "scenario": {**CIL, "participation": {"fraction": 0.5}}},
        {**base, "data": {**DATA, "train_per_class": 15}},
        {**base, "data": {**DATA, "name": "imagenet_r"}},
    ]
    for cfg in different:
        assert scenario_identity(cfg) != scenario_identity(base), cfg


def test_family_labels_are_readable_and_unique() -> None:
    assert family_label({"data": DATA, "scenario": {**CIL, "num_tasks": 5}}) == (
        "class-incremental, Dirichlet β = 0.05, 5 tasks × 10 classes, 5 clients; cifar100, 100/20 train/test per class"
    )
    hepco = {**CIL, "partition": {"kind": "hepco", "category_ratio": 0.6, "split_ratio": 0.1, "imbalance": 1.0}}
    assert family_label({"data": DATA, "scenario": hepco}).startswith(
        "class-incremental, HePCo partition (κ = 0.6, γ = 0.1, β = 1), 2 tasks × 10 classes"
    )
    asyn = {
        "kind": "asynchronous",
        "num_tasks": 3,
        "classes_per_task": 10,
        "num_clients": 5,
        "domains": {"clients": "mixed"},
    }
    assert family_label({"data": DATA, "scenario": asyn}).startswith(
        "asynchronous task switching, 3 tasks × 10 classes per client, 5 clients, per-client image domains; cifar100"
    )
    long_tail = {"kind": "long_tailed", "num_tasks": 1, "num_clients": 20, "long_tail": {"imbalance_factor": 100.0},
                 "participation": {"fraction": 0.4, "mode": "per_round"}}  # fmt: skip
    assert family_label({"data": {"name": "synthetic"}, "scenario": long_tail}) == (
        "long-tailed (IF = 100), Dirichlet β = 0.5, 1 task, 20 clients, 40% of clients per round; synthetic"
    )
    # two families whose configs read the same are told apart by the keys they differ in
    from promptfcl.report.collect import Group, RunResult

    def group(name: str, min_samples: int) -> Group:
        scenario = {**CIL, "partition": {**CIL["partition"], "min_samples": min_samples}}
        return Group(name, [RunResult(Path(name), {"seed": 0}, {"data": DATA, "scenario": scenario}, "", {})])

    a, b = group_families([group("a", 4), group("b", 6)])
    assert a.label != b.label and b.label.endswith("[scenario.partition.min_samples = 6]")


# -------------------------------------------------------------------------------------------------------- labels


def test_summary_keys_get_readable_headers_with_units_and_unknown_keys_keep_theirs() -> None:
    expected = {
        "faa": "final avg acc (%)",
        "average_forgetting": "forgetting (pts)",
        "bwt": "BWT (pts)",
        "sample_weighted_accuracy": "sample-weighted acc (%)",
        "kr_t": "KR_t (%)",
        "kr_s": "KR_s (%)",
        "task_accuracy.1": "task 1 acc (%)",
        "task_accuracy.12": "task 12 acc (%)",
        "class_groups.head": "head-class acc (%)",
        "class_groups.tail": "tail-class acc (%)",
        "mb_per_round": "comm / round (MB)",
        "wall_time": "wall time (s)",
        "valid_seeds": "valid seeds",
        "my_new_metric": "my_new_metric",
        "kr.local": "kr.local",
    }
    assert {k: label(k).header for k in expected} == expected
    # the table columns (the names summary.json keeps) map through their summary keys
    columns = {
        "FAA (%)": "final avg acc (%)",
        "forgetting (%)": "forgetting (pts)",
        "BWT (%)": "BWT (pts)",
        "head (%)": "head-class acc (%)",
        "overall (%)": "overall acc (%)",
        "MB / round": "comm / round (MB)",
        "wall time (s)": "wall time (s)",
        "task_accuracy.3": "task 3 acc (%)",
        "tail_accuracy": "tail_accuracy",
    }
    assert {c: column_label(c) for c in columns} == columns
    notes = column_notes(["FAA (%)", "task_accuracy.1", "task_accuracy.2", "tail_accuracy"])
    assert notes.count("task k acc (%)") == 1 and "final avg acc (%): " in notes and "tail_accuracy" not in notes
    defined: set[str] = set()
    column_notes(["FAA (%)"], defined)
    assert "final avg acc" not in column_notes(["FAA (%)", "kr_t"], defined)  # given once per report


@pytest.mark.parametrize("key", ["faa", "average_forgetting", "bwt", "kr_t", "task_accuracy.1", "mb_per_round"])
def test_every_labelled_column_is_defined(key: str) -> None:
    assert label(key).note
