"""`engine.kind` is the source of truth for the engine: `--engine` overrides it, the run's config.yaml records it,
`--resume` and study cells use it. Flower itself is not started here (tests/test_flower.py runs it): the engine
launches in `promptfcl.cli` are replaced by recorders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from promptfcl import cli, runtime
from promptfcl.cli import main
from promptfcl.config import ConfigError, build_config, dump_config, load_config
from promptfcl.runtime import check_config

from .conftest import tiny_config, tiny_raw

Launch = tuple[str, str, Path, bool]  # (engine launched, cfg.engine.kind it got, run dir, resume)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Record each engine launch instead of running it; Flower counts as installed."""
    calls: list[Launch] = []

    def inprocess(cfg: Any, run_dir: Path, resume: bool, quiet: bool) -> None:
        calls.append(("inprocess", cfg.engine.kind, run_dir, resume))

    def flower_sim(cfg: Any, run_dir: Path, resume: bool) -> None:
        calls.append(("flower-sim", cfg.engine.kind, run_dir, resume))

    monkeypatch.setattr(cli, "_launch_inprocess", inprocess)
    monkeypatch.setattr(cli, "_launch_flower_sim", flower_sim)
    monkeypatch.setattr(runtime, "flower_installed", lambda: True)
    return calls


def _config_file(tmp_path: Path, name: str = "cfg.yaml", **updates: Any) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tiny_raw(**updates)))
    return path


def test_the_default_engine_stays_inprocess() -> None:
    """Existing configs (and every committed run's config.yaml, which records `kind: inprocess`) compare equal."""
    from promptfcl.study import _resolved

    assert tiny_config().engine.kind == "inprocess"
    written = tiny_raw(engine={"kind": "inprocess"})
    assert build_config(written) == tiny_config()
    assert _resolved(written) == _resolved(tiny_raw())  # a study sees no changed key
    with pytest.raises(ConfigError, match="engine.kind"):
        tiny_config(engine={"kind": "flower"})


def test_the_config_picks_the_engine_and_the_flag_overrides_it(tmp_path: Path, launches: list[Launch]) -> None:
    flower = _config_file(tmp_path, "flower.yaml", engine={"kind": "flower-sim"})
    plain = _config_file(tmp_path)
    assert main(["run", str(flower), "--quiet", "--run-dir", str(tmp_path / "a")]) == 0
    assert main(["run", str(plain), "--quiet", "--run-dir", str(tmp_path / "b")]) == 0
    assert main(["run", str(plain), "--engine", "flower-sim", "--run-dir", str(tmp_path / "c")]) == 0
    assert main(["run", str(flower), "--engine", "inprocess", "--quiet", "--run-dir", str(tmp_path / "d")]) == 0
    assert [(engine, kind) for engine, kind, _, _ in launches] == [
        ("flower-sim", "flower-sim"),
        ("inprocess", "inprocess"),
        ("flower-sim", "flower-sim"),  # --engine is an override of engine.kind: the config the run gets says so
        ("inprocess", "inprocess"),
    ]
    assert not any(resume for *_, resume in launches)


def test_a_flower_sim_run_records_its_engine_and_resumes_on_it(
    tmp_path: Path, launches: list[Launch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's config.yaml (written by the run loop, as Flower's ServerApp runs it) records engine.kind; `run
    --resume RUN_DIR` reads it and launches that engine, whatever the default."""
    from promptfcl.experiment import Experiment

    def loop_as_the_server_app_runs_it(cfg: Any, run_dir: Path, resume: bool) -> None:
        launches.append(("flower-sim", cfg.engine.kind, run_dir, resume))
        Experiment(cfg, run_dir, show_progress=False).run(resume=resume)

    monkeypatch.setattr(cli, "_launch_flower_sim", loop_as_the_server_app_runs_it)
    one_round = {"num_tasks": 1, "num_clients": 2, "rounds_per_task": 1}
    plain = _config_file(tmp_path, scenario=one_round, method={"local_epochs": 1})
    run_dir = tmp_path / "sim"
    assert main(["run", str(plain), "--engine", "flower-sim", "--run-dir", str(run_dir)]) == 0
    assert load_config(run_dir / "config.yaml").engine.kind == "flower-sim"

    def record(cfg: Any, run_dir: Path, resume: bool) -> None:
        launches.append(("flower-sim", cfg.engine.kind, run_dir, resume))

    monkeypatch.setattr(cli, "_launch_flower_sim", record)
    assert main(["run", "--resume", str(run_dir)]) == 0
    assert launches[-1] == ("flower-sim", "flower-sim", run_dir, True)

    inproc = tmp_path / "inproc"  # a run recorded in-process resumes in-process
    inproc.mkdir()
    (inproc / "config.yaml").write_text(dump_config(load_config(plain)))
    assert main(["run", "--resume", str(inproc), "--quiet"]) == 0
    assert launches[-1] == ("inprocess", "inprocess", inproc, True)


def test_resume_refuses_another_engine_than_the_recorded_one(
    tmp_path: Path, launches: list[Launch], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(tiny_config(engine={"kind": "flower-sim"})))
    assert main(["run", "--resume", str(run_dir), "--engine", "inprocess"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # (the error console wraps lines)
    assert "ran on engine.kind: flower-sim" in err and "drop --engine inprocess" in err
    assert launches == []
    assert main(["run", "--resume", str(run_dir), "--engine", "flower-sim"]) == 0  # the same engine: fine
    assert launches == [("flower-sim", "flower-sim", run_dir, True)]


def test_flower_sim_without_flower_fails_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runtime, "flower_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'promptfcl\[flower\]'"):
        check_config(tiny_config(engine={"kind": "flower-sim"}))
    check_config(tiny_config())  # in-process needs no Flower
    flower = _config_file(tmp_path, engine={"kind": "flower-sim"})
    assert main(["run", str(flower), "--run-dir", str(tmp_path / "r")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "engine.kind: flower-sim" in err and "pip install 'promptfcl[flower]'" in err
    assert not (tmp_path / "r").exists()  # nothing started


def test_a_study_cell_runs_on_the_engine_its_config_names(tmp_path: Path, launches: list[Launch]) -> None:
    """A cell's `engine: {kind: flower-sim}` is merged into the base's engine section; the planned config records
    it and the cell's `promptfcl run` command carries no --engine flag (the config decides, resume too)."""
    from promptfcl.study import _command, load_study, plan

    _config_file(tmp_path, "base.yaml")
    study_file = tmp_path / "study.yaml"
    cells = {"inproc": {}, "sim": {"engine": {"kind": "flower-sim"}}}
    study_file.write_text(yaml.safe_dump({"name": "engines", "base": "base.yaml", "cells": cells}))
    study, study_dir = load_study(study_file)
    runs = {r.cell: r for r in plan(study, study_dir, tmp_path / "out")}
    sim = load_config(runs["sim"].config_path)
    assert sim.engine.kind == "flower-sim" and sim.engine.device == "cpu"  # merged, the base's device kept
    assert load_config(runs["inproc"].config_path).engine.kind == "inprocess"
    cmd = _command(runs["sim"])
    assert "--engine" not in cmd
    assert main(cmd[cmd.index("run") :]) == 0  # what the study's subprocess does
    assert launches == [("flower-sim", "flower-sim", runs["sim"].run_dir, False)]
