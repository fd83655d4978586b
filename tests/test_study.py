"""`promptfcl study`: cells x seeds from one file, validated up front, finished runs never redone."""

from __future__ import annotations

import json

import pytest
import yaml

from promptfcl.cli import main
from promptfcl.config import ConfigError
from promptfcl.study import execute, load_study, plan, select_runs, stale_runs

from .conftest import tiny_raw


def write_study(tmp_path, cells: dict, **extra) -> str:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_raw(scenario={"num_tasks": 2, "rounds_per_task": 1})))
    study = {"name": "mini", "base": "base.yaml", "seeds": [0, 1], "cells": cells, **extra}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
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
    assert "| hgp ⚠ INVALID | hgp | 2 | 0/2 (backbone_pretrained" in (out / "summary.md").read_text()  # tiny random ViT
    assert "backbone_pretrained" in rows["hgp"]["invalid"]["0"] and set(rows["hgp"]["per_seed"]) == {"0", "1"}
    cfg = yaml.safe_load((out / "configs" / "hgp_seed1.yaml").read_text())
    assert cfg["seed"] == 1 and cfg["method"]["name"] == "hgp" and cfg["method"]["length"] == 4
    study, study_dir = load_study(path)
    runs = plan(study, study_dir, out)
    assert all(r.finished for r in runs)
    assert execute(runs) == []  # nothing is redone
    assert (out / "report.md").is_file() and "data:image/png;base64," in (out / "report.html").read_text()


def test_study_refuses_a_bad_cell_before_running_anything(tmp_path) -> None:
    path = write_study(tmp_path, {"ok": {}, "bad": {"method": {"name": "hgp", "rebalanse": "all"}}})
    study, study_dir = load_study(path)
    with pytest.raises(ConfigError, match="rebalanse"):
        plan(study, study_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "ok").exists()


def test_sweeps_expand_into_the_cartesian_grid_of_each_cell(tmp_path) -> None:
    from promptfcl.study import expand_cells

    (tmp_path / "other.yaml").write_text(yaml.safe_dump(tiny_raw(scenario={"num_clients": 2})))
    path = write_study(
        tmp_path,
        {
            "plain": {},
            "lr": {"sweep": {"method.lr": [0.01, 0.001], "scenario.partition.beta": [0.5]}},
            "other": {"base": "other.yaml", "sweep": {"method.batch_size": [4]}},
        },
        sweep={"scenario.partition.beta": [0.5, 0.1]},  # study-wide; a cell's own list wins for its key
    )
    study, study_dir = load_study(path)
    names = [c.name for c in expand_cells(study)]
    assert names == [
        "plain-beta=0.5",
        "plain-beta=0.1",
        "lr-beta=0.5-lr=0.01",
        "lr-beta=0.5-lr=0.001",
        "other-beta=0.5-batch_size=4",
        "other-beta=0.1-batch_size=4",
    ]
    out = tmp_path / "out"
    runs = plan(study, study_dir, out)
    assert len(runs) == 6 * 2  # cells x seeds
    cfg = yaml.safe_load((out / "configs" / "lr-beta=0.5-lr=0.001_seed1.yaml").read_text())
    assert cfg["method"]["lr"] == 0.001 and cfg["scenario"]["partition"]["beta"] == 0.5 and cfg["seed"] == 1
    other = yaml.safe_load((out / "configs" / "other-beta=0.1-batch_size=4_seed0.yaml").read_text())
    assert other["scenario"]["num_clients"] == 2 and other["scenario"]["partition"]["beta"] == 0.1  # own base
    assert other["method"]["batch_size"] == 4
    saved = json.loads((out / "study.json").read_text())
    assert saved["cells"][3] == {"name": "lr-beta=0.5-lr=0.001", "source": "lr", "sweep": {"method.lr": 0.001,
                                 "scenario.partition.beta": 0.5}}  # fmt: skip


def test_sweep_names_use_the_full_path_when_last_parts_clash_and_bad_sweeps_are_refused(tmp_path) -> None:
    from promptfcl.study import expand_cells

    path = write_study(tmp_path, {"a": {"sweep": {"method.lr": [0.1], "data.lr": [1]}}})
    study, _ = load_study(path)
    assert [c.name for c in expand_cells(study)] == ["a-method.lr=0.1-data.lr=1"]
    for bad, msg in [
        ({"method.lr": []}, "lists no values"),
        ({"method.lr": [1, 1]}, "twice"),
        ({"a..b": [1]}, "dotted"),
    ]:
        path = write_study(tmp_path, {"a": {"sweep": bad}})
        with pytest.raises(ConfigError, match=msg):
            load_study(path)


def test_cells_and_seeds_select_a_subset_of_the_runs(tmp_path) -> None:
    """`--cells` / `--seeds` pick runs: a study cell's name selects all its sweep points, an expanded name one of
    them; unknown names and seeds outside the study are refused with the valid ones."""
    path = write_study(tmp_path, {"plain": {}, "lr": {"sweep": {"method.lr": [0.01, 0.001]}}})
    study, study_dir = load_study(path)
    runs = plan(study, study_dir, tmp_path / "out")

    def picked(cells: str | None, seeds: str | None) -> list[tuple[str, int]]:
        return [(r.cell, r.seed) for r in select_runs(study, runs, cells, seeds)]

    assert picked(None, None) == [(r.cell, r.seed) for r in runs]
    assert picked("lr", "1") == [("lr-lr=0.01", 1), ("lr-lr=0.001", 1)]
    assert picked("plain,lr-lr=0.001", None) == [("plain", 0), ("lr-lr=0.001", 0), ("plain", 1), ("lr-lr=0.001", 1)]
    with pytest.raises(ConfigError, match="no cell nope .*cells: plain, lr-lr=0.01"):
        picked("nope", None)
    with pytest.raises(ConfigError, match=r"seeds \[7\] are not among"):
        picked(None, "0,7")


def test_missing_backbone_weights_fall_back_to_a_labelled_random_init_only_when_asked(tmp_path) -> None:
    from promptfcl.study import cell_config

    cells = {"a": {"set": [f"backbone.weights={tmp_path / 'absent.safetensors'}"]}}
    path = write_study(tmp_path, cells)
    study, study_dir = load_study(path)
    with pytest.raises(ConfigError, match="backbone.weights"):
        plan(study, study_dir, tmp_path / "out")  # default: a missing weights file is an error
    path = write_study(tmp_path, cells, missing_weights="random_init")
    study, study_dir = load_study(path)
    cfg = cell_config(study, study_dir, "a", 0)
    assert cfg.backbone.weights is None and cfg.name == "mini_a_RANDOM_INIT"
    assert plan(study, study_dir, tmp_path / "out2")[0].config_path.read_text().count("RANDOM_INIT") == 1


@pytest.mark.slow
def test_interrupted_study_starts_nothing_new_and_resumes_without_redoing(tmp_path) -> None:
    """A signal to the study process alone: no further run starts, the running one checkpoints and stops, and
    the same command afterwards finishes the rest without redoing the finished run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_raw(scenario={"num_tasks": 2, "rounds_per_task": 3})))
    study = {"name": "mini", "base": "base.yaml", "seeds": [0, 1, 2], "cells": {"fedavg_prompt": {}}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "promptfcl", "study", str(path), "--out", str(out), "--jobs", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seed0, seed1 = out / "fedavg_prompt" / "seed0", out / "fedavg_prompt" / "seed1"
    deadline = time.time() + 300
    while not ((seed0 / "metrics.json").is_file() and (seed1 / "rounds.jsonl").is_file()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)  # the study alone, not its process group
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, output
    assert "study interrupted: 1 of 3 runs finished" in " ".join(output.split())
    assert not (seed1 / "metrics.json").is_file() and (seed1 / "checkpoint.safetensors").is_file()
    assert not (out / "fedavg_prompt" / "seed2").exists()  # never started
    summary = json.loads((out / "summary.json").read_text())  # written on the way out: the finished run only
    assert [(r["cell"], r["seeds"]) for r in summary["rows"]] == [("fedavg_prompt", 1)]
    finished_at = (seed0 / "metrics.json").stat().st_mtime_ns
    assert main(["study", str(path), "--out", str(out), "--jobs", "1"]) == 0
    assert (seed0 / "metrics.json").stat().st_mtime_ns == finished_at  # not redone
    assert all((out / "fedavg_prompt" / f"seed{s}" / "metrics.json").is_file() for s in range(3))


def test_a_run_started_under_another_config_than_its_cells_is_refused_or_moved_aside(tmp_path) -> None:
    """Finished runs are never redone, so a cell whose config changed after some seeds ran would silently average
    seeds of two configs. A started run is compared with its cell after validation (a field added later with its
    default and the machine's data path are no change); a real change is refused with the run and the key named,
    or, asked to, the run is moved aside (kept) and runs again."""
    path = write_study(tmp_path, {"a": {"method": {"name": "fedavg_prompt", "lr": 0.01}}})
    study, study_dir = load_study(path)
    out = tmp_path / "out"
    runs = plan(study, study_dir, out)
    for r in runs:  # as if each had started: the run writes its resolved config
        saved = yaml.safe_load(r.config_path.read_text())
        del saved["engine"]["precision"]  # written before that field existed: its default now
        saved["data"]["root"] = str(tmp_path / "elsewhere")  # another machine's copy of the data
        saved["name"] = "another_study_a"  # moved here from another study
        r.run_dir.mkdir(parents=True)
        (r.run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    assert stale_runs(runs) == []
    from promptfcl.registry import METHODS

    default = METHODS.get("fedavg_prompt").params().batch_size  # written out at its default: no change either
    path = write_study(tmp_path, {"a": {"method": {"name": "fedavg_prompt", "lr": 0.01, "batch_size": default}}})
    study, study_dir = load_study(path)
    assert stale_runs(plan(study, study_dir, out)) == []
    path = write_study(tmp_path, {"a": {"method": {"name": "fedavg_prompt", "lr": 0.02}}})
    study, study_dir = load_study(path)
    runs = plan(study, study_dir, out)
    with pytest.raises(ConfigError, match=r"a seed 0 .*method\.lr"):
        stale_runs(runs)
    assert all(r.run_dir.is_dir() for r in runs)  # refusing moves nothing
    moved = stale_runs(runs, rerun=True)
    assert [(r.cell, r.seed) for r in moved] == [("a", 0), ("a", 1)]
    assert not runs[0].run_dir.exists() and (out / "a" / "seed0.replaced-1" / "config.yaml").is_file()
    assert stale_runs(plan(study, study_dir, out)) == []


def test_probe_row_leaves_out_label_space_classes_no_client_trains_on(tmp_path, monkeypatch) -> None:
    """A Dirichlet split can leave a class of a client's task without a training image; the probe row cannot fit
    such a class, so it is scored without it and the class is recorded (it used to stop the probe with an error)."""
    import numpy as np

    from promptfcl.frozen_probe import probe_run
    from promptfcl.runtime import Runtime

    from .conftest import tiny_config

    cfg = tiny_config()
    rt = Runtime.build(cfg)
    gone = int(rt.scenario.label_space.tasks[0].classes[0])
    targets = rt.dataset.train.targets.numpy()
    rt.scenario.client_train = [[np.asarray(i)[targets[np.asarray(i)] != gone] for i in row]
                                for row in rt.scenario.client_train]  # fmt: skip
    monkeypatch.setattr(Runtime, "build", classmethod(lambda cls, *a, **k: rt))
    metrics = probe_run(cfg, tmp_path / "probe")
    listed = {int(c) for t in rt.scenario.label_space.tasks for c in t.classes}
    assert metrics["probe"]["classes_without_training_images"] == [gone]
    assert metrics["probe"]["classes"] == len(listed) - 1
