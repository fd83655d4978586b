"""`promptfcl study`: cells x seeds from one file, validated up front, finished runs never redone."""

from __future__ import annotations

import json

import pytest
import yaml

from promptfcl.cli import main
from promptfcl.config import ConfigError
from promptfcl.study import execute, load_study, plan

from .conftest import tiny_raw


def write_study(tmp_path, cells: dict) -> str:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_raw(scenario={"num_tasks": 2, "rounds_per_task": 1})))
    study = {"name": "mini", "base": "base.yaml", "seeds": [0, 1], "cells": cells}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return str(path)


@pytest.mark.slow
def test_study_runs_every_cell_and_seed_once(tmp_path) -> None:
    path = write_study(
        tmp_path,
        {
            "fedavg_prompt": {},
            "hgp": {"method": {"name": "hgp", "length": 4, "layers": [0, 1], "local_epochs": 1, "batch_size": 8}},
        },
    )
    out = tmp_path / "out"
    assert main(["study", path, "--out", str(out), "--jobs", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["cell"]: r for r in summary["rows"]}
    assert rows["hgp"]["method"] == "hgp" and rows["fedavg_prompt"]["seeds"] == 2
    assert "| hgp | hgp | 2 |" in (out / "summary.md").read_text()
    cfg = yaml.safe_load((out / "configs" / "hgp_seed1.yaml").read_text())
    assert cfg["seed"] == 1 and cfg["method"]["name"] == "hgp" and cfg["method"]["length"] == 4
    study, study_dir = load_study(path)
    runs = plan(study, study_dir, out)
    assert all(r.finished for r in runs)
    assert execute(runs) == []  # nothing is redone


def test_study_refuses_a_bad_cell_before_running_anything(tmp_path) -> None:
    path = write_study(tmp_path, {"ok": {}, "bad": {"method": {"name": "hgp", "rebalanse": "all"}}})
    study, study_dir = load_study(path)
    with pytest.raises(ConfigError, match="rebalanse"):
        plan(study, study_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "ok").exists()
