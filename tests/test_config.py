"""Bad configs fail before training with messages that name the key and the fix — never a traceback."""

from __future__ import annotations

import pytest

from promptfcl.cli import main
from promptfcl.config import ConfigError, build_config, load_config
from promptfcl.experiment import Experiment, check_config

from .conftest import tiny_config, tiny_raw


def error_of(**updates) -> str:
    with pytest.raises(ConfigError) as e:
        check_config(build_config(tiny_raw(**updates)))
    return str(e.value)


def test_unknown_key_suggests_the_right_one() -> None:
    msg = error_of(scenario={"num_task": 3})
    assert "scenario.num_task: unknown key; did you mean 'num_tasks'?" in msg


def test_bad_types_and_ranges() -> None:
    assert "scenario.num_clients" in error_of(scenario={"num_clients": "many"})
    assert "scenario.partition.beta" in error_of(scenario={"partition": {"beta": -1}})
    assert "scenario.participation.fraction" in error_of(scenario={"participation": {"fraction": 1.5}})


def test_unknown_method_dataset_and_method_params() -> None:
    assert "Did you mean 'fedavg_prompt'" in error_of(method={"name": "fedavg_promt"})
    assert "unknown dataset 'cifar1000'" in error_of(data={"name": "cifar1000"})
    assert "method.lrr: unknown key; did you mean 'lr'?" in error_of(method={"lrr": 0.1})
    assert "method.lr" in error_of(method={"lr": "fast"})


def test_missing_data_names_the_folder_and_files(tmp_path) -> None:
    raw = tiny_raw()
    raw["data"] = {"name": "cifar100", "root": str(tmp_path / "nowhere")}
    with pytest.raises(ConfigError) as e:
        check_config(build_config(raw))
    msg = str(e.value)
    assert "expected the python release in" in msg and "train, test, meta" in msg and "data.root" in msg


def test_impossible_scenarios() -> None:
    assert "lower scenario.num_tasks" in error_of(scenario={"num_tasks": 4, "classes_per_task": 2})
    msg = error_of(scenario={"num_tasks": 4})
    assert "do not split evenly" in msg


def test_impossible_partition_is_reported_before_training(tmp_path) -> None:
    cfg = tiny_config(scenario={"num_clients": 3, "partition": {"min_samples": 60}})
    with pytest.raises(ConfigError, match="min_samples"):
        Experiment(cfg, tmp_path / "run", show_progress=False).run()
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


def test_backbone_errors() -> None:
    assert "timm has no model" in error_of(backbone={"name": "vit_nonexistent"})
    assert "backbone.weights" in error_of(backbone={"weights": "/no/such/file.safetensors"})


def test_overrides_and_yaml(tmp_path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("scenario:\n  num_tasks: 3\nmethod:\n  name: fedvit\n")
    cfg = load_config(p, ["scenario.num_tasks=5", "method.lr=0.01", "data.options.num_classes=10"])
    assert cfg.scenario.num_tasks == 5 and cfg.method.params_dict()["lr"] == 0.01
    assert cfg.data.options["num_classes"] == 10
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(p, ["nonsense"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_exponent_floats_are_numbers_in_files_overrides_and_dumps(tmp_path) -> None:
    """`1e-4` without a dot is a float (YAML 1.2; PyYAML's YAML 1.1 reads it as a string) in a config file and in an
    override, so the dumped config holds a number and a re-read compares equal (study runs are matched this way)."""
    from promptfcl.config import dump_config, load_yaml

    p = tmp_path / "c.yaml"
    p.write_text("method:\n  name: fedvit\n  lr: 1e-4\n")
    cfg = load_config(p, ["method.weight_decay=1e-07"])
    params = cfg.method.params_dict()
    assert params["lr"] == 1e-4 and params["weight_decay"] == 1e-7
    again = load_yaml(dump_config(cfg))["method"]
    assert isinstance(again["lr"], float) and again["weight_decay"] == 1e-7
    assert load_yaml("a: 1e\nb: e5\nc: 12") == {"a": "1e", "b": "e5", "c": 12}  # not numbers / still an int


def test_cli_prints_errors_without_traceback(tmp_path, capsys) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("scenario:\n  num_clientz: 3\n")
    assert main(["run", str(p), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "num_clientz" in err and "Traceback" not in err
    assert main(["run", "--resume", str(tmp_path / "nothing")]) == 2


def test_corrupt_dataset_file_is_a_clear_error(tmp_path, capsys) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test", "meta"):
        (folder / name).write_bytes(b"not the release")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {{name: cifar100, root: {folder}}}\n")
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "md5" in err and "Traceback" not in err


def test_cli_list_shows_registries(capsys) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "fedavg_prompt" in out and "cifar100" in out and "vit_base_patch16_224" in out


def test_every_shipped_config_and_study_validates(monkeypatch) -> None:
    """Presets must not drift from the schema: every YAML under configs/ and every study cell validates."""
    from pathlib import Path

    from promptfcl.config import load_config
    from promptfcl.runtime import resolve_method
    from promptfcl.study import cell_config, expand_cells, load_study

    monkeypatch.setenv("PROMPTFCL_ASSETS", "/assets")
    monkeypatch.setenv("PROMPTFCL_DATA", "/data")
    root = Path(__file__).resolve().parents[1]
    papers = root / "configs" / "papers"  # study files, one per paper table
    configs = sorted(p for p in (root / "configs").rglob("*.yaml") if papers not in p.parents)
    assert len(configs) >= 18
    for path in configs:
        resolve_method(load_config(path))
    from promptfcl.claims import load_claims
    from promptfcl.config import read_yaml

    studies = sorted((root / "benchmarks").glob("*.yaml")) + sorted(papers.rglob("*.yaml"))
    claims = [p for p in studies if "claims" in read_yaml(p)]  # claims files name studies, they are not studies
    assert claims
    for path in claims:
        load_claims(path)
    studies = [p for p in studies if p not in claims]
    assert len(studies) >= 12
    for path in studies:
        study, study_dir = load_study(path)
        for cell in expand_cells(study):
            resolve_method(cell_config(study, study_dir, cell, study.seeds[0]))
