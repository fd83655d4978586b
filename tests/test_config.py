"""Bad configs fail before training with messages that name the key and the fix — never a traceback."""

from __future__ import annotations

import re

import pytest
import yaml

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


def _cells(line: str) -> list[str]:
    """A row of `promptfcl show`'s plain-text table: key, type, default, description (columns 2+ spaces apart)."""
    return re.split(r"\s{2,}", line.strip())


def test_show_lists_every_hyper_parameter_as_a_config_key(capsys) -> None:
    """`promptfcl show METHOD`: summary, paper, scenario kinds, source file, then one row per parameter with the key
    a config writes (nested sections flattened with dots), a readable type, the default and the description."""
    assert main(["show", "hgp"]) == 0
    out = capsys.readouterr().out
    assert "scenario kinds: any" in out and "paper: HGP" in out
    assert re.search(r"source: promptfcl/methods/hgp(/__init__)?\.py", out)
    assert "paper's hyper-parameters" in out and "paper-vs-code switch" in out
    rows = {cells[0]: cells for line in out.splitlines() if (cells := _cells(line))[0].startswith("method.")}
    assert rows["method.length"][1:3] == ["int (>= 0)", "200"] and "prefix tokens" in rows["method.length"][3]
    assert rows["method.lr"][2] in ("0.003", "3e-3") and "Appendix H" in rows["method.lr"][3]
    assert rows["method.optimizer"][1:3] == ["adam | adamw | sgd", "adam"]  # a Literal, as its choices
    assert rows["method.grad_clip"][1].startswith("float | None")  # optional
    assert rows["method.layers"][1] == "list[int]"
    assert rows["method.aggregation.rule"][1:3] == ["mean | median | trimmed_mean", "mean"]  # nested, flattened
    assert rows["method.aggregation.max_update_norm"][2] == "null"
    assert "method.calibration.lr" in rows and "method.privacy.epsilon" in rows and "method.aggregation" not in rows
    assert len(out.splitlines()) == len(set(out.splitlines()))  # a parameter per line: nothing wrapped


def test_show_names_the_scenario_kinds_and_refuses_unknown_methods(capsys) -> None:
    assert main(["show", "fedmgp"]) == 0
    assert "scenario kinds: personalized" in capsys.readouterr().out
    assert main(["show", "ccvr"]) == 0  # its own folder first, then the shared programs' module
    source = r"source: promptfcl/methods/ccvr\S* \(method, parameters\); \S+ \(server program, client program\)"
    assert re.search(source, capsys.readouterr().out)
    assert main(["show", "hgpp"]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'hgpp'" in err and "Did you mean 'hgp'?" in err and "Traceback" not in err


def test_type_labels_read_as_a_config_writer_reads_them() -> None:
    from typing import Literal

    from promptfcl.cli import default_label, type_label

    assert type_label(Literal["a", "b", "c"]) == "a | b | c"
    assert type_label(Literal["a", "b"] | None) == "a | b | None"
    assert type_label(list[int] | None) == "list[int] | None"
    assert type_label(tuple[float, float]) == "tuple[float, float]" and type_label(float) == "float"
    assert [default_label(v) for v in (None, True, 3e-3, 1e-8, [0, 1], "", "adam")] == [
        "null", "true", "0.003", "1e-08", "[0, 1]", '""', "adam",
    ]  # fmt: skip


def test_list_shows_the_scenario_kinds_of_every_method(capsys) -> None:
    assert main(["list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert "scenario kinds" in lines["name"]
    assert "personalized" in lines["fedmgp"] and "class_incremental, long_tailed" in lines["lorm"]
    assert _cells(lines["hgp"])[1] == "any"


@pytest.mark.parametrize(
    ("override", "section", "kind"),
    [
        ("scenario.personalized.beta=0.1", "personalized", "personalized"),
        ("scenario.asynchronous.data_slices=3", "asynchronous", "asynchronous"),
        ("scenario.long_tail.imbalance_factor=10", "long_tail", "long_tailed"),
        ("scenario.long_tail.profile=dataset", "long_tail", "long_tailed"),
    ],
)
def test_a_section_of_another_scenario_kind_is_refused(tmp_path, capsys, override, section, kind) -> None:
    """A kind-specific section changed from its defaults under another scenario.kind would be silently ignored."""
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(tiny_raw()))
    with pytest.raises(ConfigError) as e:
        load_config(p, [override])
    msg = str(e.value)
    assert f"scenario.{section} applies to scenario.kind: {kind}, not class_incremental; set scenario.kind: " in msg
    assert f" or drop scenario.{section}" in msg
    if section == "personalized":
        assert (
            "scenario.personalized applies to scenario.kind: personalized, not class_incremental; set scenario.kind: "
            "personalized or drop scenario.personalized"
        ) in msg
    assert override.rsplit(".", 1)[1] in msg and msg.count("applies to") == 1  # names the key, says it once
    assert main(["run", str(p), "--set", override, "--run-dir", str(tmp_path / "r")]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_kind_sections_at_their_defaults_or_under_their_kind_are_accepted(tmp_path) -> None:
    """Every dumped config.yaml writes every section at its defaults: they must keep loading."""
    from promptfcl.config import dump_config, load_yaml

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(tiny_raw()))
    cfg = load_config(p, ["scenario.personalized.beta=1.0", "scenario.long_tail.profile=exponential"])  # defaults
    assert build_config(load_yaml(dump_config(cfg))) == cfg
    assert load_config(p, ["scenario.kind=personalized", "scenario.personalized.beta=0.1"]).scenario.personalized.beta
    lt = ["scenario.kind=long_tailed", "scenario.num_tasks=1", "scenario.long_tail.imbalance_factor=10"]
    assert load_config(p, lt).scenario.long_tail.imbalance_factor == 10


def test_every_committed_run_config_still_loads() -> None:
    """`promptfcl run --resume` and study comparisons reload the config.yaml a run dumped (every section written
    out at its values then): the committed run directories' configs must keep validating."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    paths = sorted(root.rglob("config.yaml"))
    if not paths:
        pytest.skip(f"no committed run directories (config.yaml) under {root}")
    for path in paths:
        try:
            load_config(path)
        except ConfigError as e:
            raise AssertionError(f"{path.relative_to(root)} no longer loads:\n{e}") from None


def test_an_unset_environment_variable_in_a_path_is_named(tmp_path, monkeypatch, capsys) -> None:
    """`${PROMPTFCL_ASSETS}/…` with the variable unset: loading works (configs are read without assets), using it
    names the variable and how to set it instead of reporting a literal `${…}` folder as missing."""
    monkeypatch.delenv("PROMPTFCL_ASSETS", raising=False)
    raw = tiny_raw()
    raw["data"] = {"name": "cifar100", "root": "${PROMPTFCL_ASSETS}/cifar-100-python"}
    raw["backbone"]["weights"] = "$PROMPTFCL_ASSETS/models/vit.safetensors"
    cfg = build_config(raw)
    assert cfg.data.root == "${PROMPTFCL_ASSETS}/cifar-100-python"
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    msg = str(e.value)
    assert (
        "environment variable PROMPTFCL_ASSETS is not set (data.root: ${PROMPTFCL_ASSETS}/cifar-100-python); "
        "export PROMPTFCL_ASSETS=/path/to/assets"
    ) in msg
    assert "(backbone.weights: $PROMPTFCL_ASSETS/models/vit.safetensors)" in msg
    assert "expected the python release" not in msg and "not found" not in msg  # not a missing folder or file
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "r")]) == 2
    assert "export PROMPTFCL_ASSETS=" in capsys.readouterr().err
    monkeypatch.setenv("PROMPTFCL_ASSETS", str(tmp_path))  # set: expanded when loaded, then the folder is checked
    cfg = build_config(raw)
    assert cfg.data.root == f"{tmp_path}/cifar-100-python"
    with pytest.raises(ConfigError, match="expected the python release in") as e:
        check_config(cfg)
    assert "environment variable" not in str(e.value)
