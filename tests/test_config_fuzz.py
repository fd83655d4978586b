"""Property-based fuzzing of the config schema and the scenario builder (hypothesis).

Every generated config holds exactly one mistake. Validation (`build_config` + `check_config`, what `promptfcl
run` does before loading anything) must raise `ConfigError` — never another exception — whose message names the
broken field and says how to fix it. Corrupt and missing dataset files must give clear errors too.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from promptfcl import config as C
from promptfcl.cli import main
from promptfcl.config import ConfigError, ScenarioConfig, build_config
from promptfcl.methods import METHODS
from promptfcl.methods.base.fedavg import AggregationParams
from promptfcl.runtime import check_config
from promptfcl.scenario import build_class_incremental
from promptfcl.scenario.partition import PartitionError

from .conftest import tiny_raw

EXAMPLES = 250
FIX = re.compile(
    r"should|did you mean|allowed keys|use |set |remove|lower|raise|must|expected|add |give|list |try|needs|replace",
    re.I,
)
words = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
not_a_number = st.one_of(
    words.filter(lambda w: w not in {"inf", "nan", "infinity"}), st.lists(st.integers(), max_size=2)
)
not_a_bool = words.filter(lambda w: w.lower() not in {"true", "false", "yes", "no", "on", "off", "y", "n", "t", "f"})
non_positive = st.integers(-1000, 0)


def literal_values(model: type, field: str) -> set[str]:
    """Every string a Literal field (possibly inside a union) accepts."""
    out: set[str] = set()
    todo = [model.model_fields[field].annotation]  # type: ignore[attr-defined]
    while todo:
        t = todo.pop()
        if get_origin(t) is Literal:
            out |= {a for a in get_args(t) if isinstance(a, str)}
        else:
            todo += list(get_args(t))
    return out


def not_one_of(model: type, field: str) -> st.SearchStrategy[str]:
    allowed = literal_values(model, field)
    return words.filter(lambda w: w not in allowed)


negative = st.integers(-1000, -1)

# (dotted path, strategy of values that must be refused)
FIELDS: list[tuple[str, st.SearchStrategy[Any]]] = [
    ("seed", st.one_of(words, st.floats(0.1, 0.9))),
    ("data.train_per_class", st.one_of(non_positive, not_a_number)),
    ("data.test_per_class", non_positive),
    ("data.download", not_a_bool),
    ("scenario.num_tasks", st.one_of(non_positive, not_a_number)),
    ("scenario.num_clients", st.one_of(non_positive, not_a_number)),
    ("scenario.rounds_per_task", non_positive),
    ("scenario.classes_per_task", st.one_of(non_positive, st.lists(non_positive, min_size=1, max_size=3))),
    ("scenario.class_order", not_one_of(C.ScenarioConfig, "class_order")),
    ("scenario.partition.kind", not_one_of(C.PartitionConfig, "kind")),
    ("scenario.partition.beta", st.one_of(st.floats(-10, 0), not_a_number)),
    ("scenario.partition.min_samples", negative),
    ("scenario.partition.category_ratio", st.one_of(st.floats(1.01, 10), st.floats(-1, 0))),
    ("scenario.partition.split_ratio", st.floats(1.01, 10)),
    ("scenario.participation.fraction", st.one_of(st.floats(1.01, 5), st.floats(-1, 0))),
    ("scenario.participation.mode", not_one_of(C.ParticipationConfig, "mode")),
    ("backbone.img_size", non_positive),
    ("backbone.interpolation", not_one_of(C.BackboneConfig, "interpolation")),
    ("backbone.mean", st.lists(st.floats(0, 1), min_size=4, max_size=5)),
    ("engine.device", not_one_of(C.EngineConfig, "device")),
    ("engine.threads", non_positive),
    ("engine.min_clients", non_positive),
    ("engine.round_retries", negative),
    ("engine.client_timeout", st.floats(-5, 0)),
    ("eval.batch_size", non_positive),
    ("eval.every_round", not_a_bool),
    ("method.lr", st.one_of(st.floats(-1, 0), not_a_number)),
    ("method.local_epochs", non_positive),
    ("method.batch_size", non_positive),
    ("method.weighting", not_one_of(METHODS.get("fedavg_prompt").params, "weighting")),
    ("method.aggregation.rule", not_one_of(AggregationParams, "rule")),
    ("method.aggregation.trim_fraction", st.floats(0.5, 3)),
]
SECTIONS = ["", "data", "scenario", "scenario.partition", "scenario.participation", "backbone", "engine", "eval"]
KNOWN = {
    "": set(C.ExperimentConfig.model_fields),
    "data": set(C.DataConfig.model_fields),
    "scenario": set(C.ScenarioConfig.model_fields),
    "scenario.partition": set(C.PartitionConfig.model_fields),
    "scenario.participation": set(C.ParticipationConfig.model_fields),
    "backbone": set(C.BackboneConfig.model_fields),
    "engine": set(C.EngineConfig.model_fields),
    "eval": set(C.EvalConfig.model_fields),
}


METHOD_NAMES = {name for name, _ in METHODS.items()}  # hypothesis also draws the code's own string constants
METHOD_KEYS = set(METHODS.get("fedavg_prompt").params.model_fields) | {"name"}


def set_path(raw: dict[str, Any], path: str, value: Any) -> None:
    node = raw
    *parents, leaf = path.split(".") if path else [""]
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value


@st.composite
def broken_configs(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """(a config with one mistake, text its error must contain)."""
    raw = tiny_raw()
    raw["engine"] = {"device": "cpu"}
    case = draw(st.sampled_from(["field", "unknown_key", "not_a_section", "method", "cross", "fault"]))
    if case == "field":
        path, values = draw(st.sampled_from(FIELDS))
        set_path(raw, path, draw(values))
        return raw, path
    if case == "unknown_key":
        section = draw(st.sampled_from(SECTIONS))
        key = draw(words.filter(lambda w: w not in KNOWN[section]))
        if section:
            set_path(raw, f"{section}.{key}", 1)
        else:
            raw[key] = 1
        return raw, f"{section}.{key}".lstrip(".")
    if case == "not_a_section":
        section = draw(st.sampled_from(["data", "scenario", "backbone", "engine", "eval"]))
        raw[section] = draw(st.one_of(st.integers(), words))
        return raw, section
    if case == "method":
        kind = draw(st.sampled_from(["name", "key"]))
        if kind == "name":
            raw["method"]["name"] = draw(words.filter(lambda w: w not in METHOD_NAMES))
            return raw, "method.name"
        key = draw(words.filter(lambda w: w not in METHOD_KEYS and len(w) > 2))
        raw["method"][key] = 1
        return raw, f"method.{key}"
    if case == "cross":
        kind = draw(st.sampled_from(["too_many_tasks", "list_length", "uneven", "order"]))
        if kind == "too_many_tasks":
            raw["scenario"].update(num_tasks=draw(st.integers(7, 50)), classes_per_task=1)
            return raw, "scenario.num_tasks"
        if kind == "list_length":
            raw["scenario"]["classes_per_task"] = draw(st.lists(st.integers(1, 2), min_size=3, max_size=5))
            return raw, "scenario.classes_per_task"
        if kind == "uneven":
            raw["scenario"]["num_tasks"] = draw(st.sampled_from([4, 5]))
            return raw, "scenario.classes_per_task"
        raw["scenario"]["class_order"] = draw(
            st.one_of(st.lists(st.integers(6, 99), min_size=1, max_size=6), st.just([0, 0, 1, 2, 3, 4]), st.just([0]))
        )
        return raw, "scenario.class_order"
    kind = draw(st.sampled_from(["kind", "client", "round", "slow", "task"]))
    if kind == "kind":
        raw["engine"]["faults"] = [{"kind": draw(not_one_of(C.FaultSpec, "kind"))}]
        return raw, "engine.faults.0.kind"
    if kind == "client":
        raw["engine"]["faults"] = [{"kind": "raise", "client": draw(st.integers(3, 100))}]
        return raw, "engine.faults.0.client"
    if kind == "round":
        raw["engine"]["faults"] = [{"kind": "raise", "rounds": [draw(st.integers(2, 100))]}]
        return raw, "engine.faults.0.rounds"
    if kind == "task":
        raw["engine"]["faults"] = [{"kind": "raise", "tasks": [draw(st.integers(-100, -1))]}]
        return raw, "engine.faults.0.tasks"
    raw["engine"]["faults"] = [{"kind": "slow"}]
    return raw, "engine.client_timeout"


def validation_error(raw: dict[str, Any]) -> str:
    """The message of the `ConfigError` validation raises; any other outcome fails the test."""
    try:
        check_config(build_config(copy.deepcopy(raw)))
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"accepted an invalid config: {raw}")


def test_every_invalid_config_names_the_field_and_the_fix() -> None:
    tried: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(broken_configs())
    def check(case: tuple[dict[str, Any], str]) -> None:
        raw, field = case
        msg = validation_error(raw)
        assert field in msg, f"{field!r} not named in: {msg}"
        assert FIX.search(msg), f"no fix given in: {msg}"
        tried.append(field)

    check()
    assert len(tried) >= 200, f"only {len(tried)} invalid configs tried"
    assert len(set(tried)) >= 40  # the mistakes cover the schema, not one field


def test_cli_reports_fuzzed_mistakes_without_a_traceback(tmp_path: Path, capsys) -> None:
    seen = 0

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(broken_configs())
    def check(case: tuple[dict[str, Any], str]) -> None:
        nonlocal seen
        raw, field = case
        cfg = tmp_path / "c.yaml"
        cfg.write_text(yaml.safe_dump(raw))
        assert main(["run", str(cfg), "--run-dir", str(tmp_path / "never"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "error:" in err
        assert not (tmp_path / "never" / "checkpoint.safetensors").exists()
        seen += 1

    check()
    assert seen == 15


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    num_tasks=st.integers(1, 12),
    classes_per_task=st.one_of(st.none(), st.integers(1, 8), st.lists(st.integers(1, 5), min_size=1, max_size=6)),
    class_order=st.one_of(st.just("natural"), st.lists(st.integers(-3, 15), max_size=14)),
    num_clients=st.integers(1, 30),
    min_samples=st.integers(0, 40),
    kind=st.sampled_from(["dirichlet", "iid"]),
)
def test_scenario_builder_either_builds_or_raises_a_partition_error(
    num_tasks: int, classes_per_task: Any, class_order: Any, num_clients: int, min_samples: int, kind: str
) -> None:
    """Any scenario over a 12-class dataset builds a consistent split or raises `PartitionError` with a fix."""
    y = np.repeat(np.arange(12), 10)
    cfg = ScenarioConfig(
        num_tasks=num_tasks,
        classes_per_task=classes_per_task,
        class_order=class_order,
        num_clients=num_clients,
        partition={"kind": kind, "min_samples": min_samples, "max_retries": 20},
    )
    try:
        sc = build_class_incremental(cfg, y, y, 12, 0)
    except PartitionError as e:
        assert "scenario." in str(e) and FIX.search(str(e)), str(e)
        return
    for t in range(sc.num_tasks):
        idx = np.concatenate([sc.client_indices(t, c) for c in range(sc.num_clients)])
        assert set(y[idx].tolist()) <= set(sc.task_classes[t])


def test_missing_and_corrupt_dataset_files_are_clear_errors(tmp_path: Path, capsys) -> None:
    from promptfcl.data.base import DataMissingError
    from promptfcl.data.cifar import CifarOptions, load_cifar100

    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test", "meta"):
        (folder / name).write_bytes(b"\x80\x04\x95garbage")  # a truncated pickle stream
    with pytest.raises(DataMissingError, match="truncated"):
        load_cifar100(folder, CifarOptions(verify_md5=False), False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump({"data": {"name": "cifar100", "root": str(folder), "options": {"verify_md5": False}}})
    )
    assert main(["run", str(cfg), "--run-dir", str(tmp_path / "r"), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "truncated" in err and "Traceback" not in err
    (folder / "meta").unlink()
    with pytest.raises(DataMissingError, match="missing: meta"):
        load_cifar100(folder, CifarOptions(verify_md5=False), False)

    from promptfcl.data.cache import decode_in_memory
    from promptfcl.data.image_folder import ImageFolderOptions, load_image_folder

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    (imgs / "train.txt").write_text("a.jpg 0\n")
    (imgs / "test.txt").write_text("b.jpg 0\n")
    (imgs / "a.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(DataMissingError, match="could not be decoded as an image"):
        decode_in_memory(load_image_folder(imgs, ImageFolderOptions(decode_size=8), False).train)
    (imgs / "a.jpg").unlink()
    with pytest.raises(DataMissingError, match="listed in the split file but does not exist"):
        decode_in_memory(load_image_folder(imgs, ImageFolderOptions(decode_size=8), False).train)
    (imgs / "train.txt").write_text("a.jpg zero\n")
    with pytest.raises(DataMissingError, match="expected '<relative path> <class id>'"):
        load_image_folder(imgs, ImageFolderOptions(decode_size=8), False)
