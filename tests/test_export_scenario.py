"""`promptfcl export-scenario`: the exported arrays are exactly what a run with the same config uses (images after
decode/resize, labels, scenario indices), and exporting again gives the same bytes."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from promptfcl.cli import main
from promptfcl.export import config_hash, export_scenario
from promptfcl.runtime import Runtime

from .conftest import tiny_config, tiny_raw


def cell(flat: np.ndarray, offsets: np.ndarray, *index: int) -> np.ndarray:
    """Row `index` of a ragged array (offsets of shape (..., n + 1))."""
    row = offsets[index[:-1]] if len(index) > 1 else offsets
    return flat[row[index[-1]] : row[index[-1] + 1]]


def check_round_trip(npz: np.lib.npyio.NpzFile, rt: Runtime) -> None:
    sc, ds = rt.scenario, rt.dataset
    assert np.array_equal(npz["train_labels"], ds.train.targets.numpy())
    assert np.array_equal(npz["test_labels"], ds.test.targets.numpy())
    assert npz["class_order"].tolist() == sc.class_order
    for t, classes in enumerate(sc.task_classes):
        assert cell(npz["task_classes"], npz["task_classes_offsets"], t).tolist() == classes
        assert np.array_equal(cell(npz["test_indices"], npz["test_offsets"], t), sc.test_indices[t])
    assert npz["client_train_offsets"].shape == (sc.num_tasks, sc.num_clients + 1)
    for t in range(sc.num_tasks):
        for k in range(sc.num_clients):
            got = cell(npz["client_train"], npz["client_train_offsets"], t, k)
            assert np.array_equal(got, sc.client_indices(t, k)), (t, k)
        for r in range(sc.rounds_per_task):
            assert cell(npz["participants"], npz["participants_offsets"], t, r).tolist() == sc.participants[t][r]
    assert int(npz["client_train_offsets"][-1, -1]) == len(npz["client_train"])  # nothing beyond the last cell
    meta = json.loads(npz["meta_json"].tobytes())
    assert meta["seed"] == rt.cfg.seed
    canonical = json.dumps(rt.cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert meta["config_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()
    assert yaml.safe_load(meta["config_yaml"]) == rt.cfg.model_dump(mode="json")
    assert json.loads(npz["scenario_json"].tobytes())["client_train"] == sc.to_json()["client_train"]


def test_export_round_trips_what_the_run_uses_and_is_byte_identical_again(tmp_path, monkeypatch) -> None:
    cfg = tiny_config(scenario={"participation": {"fraction": 0.6, "mode": "per_round"}})
    meta = export_scenario(cfg, tmp_path / "a.npz")
    rt = Runtime.build(cfg)
    with np.load(tmp_path / "a.npz", allow_pickle=False) as npz:
        check_round_trip(npz, rt)
        # stored at the backbone's size (32 px): the very bytes the run feeds its transform
        assert npz["train_images"].dtype == np.uint8
        assert np.array_equal(npz["train_images"], rt.dataset.train.images.numpy())
        assert np.array_equal(npz["test_images"], rt.dataset.test.images.numpy())
    assert meta["images"]["resize"].startswith("none")
    assert json.loads((tmp_path / "a.json").read_text()) == meta
    # a later export (another wall-clock time) of the same config: the same bytes, archive and sidecar
    later = time.time() + 86_400
    monkeypatch.setattr(time, "time", lambda: later)
    export_scenario(cfg, tmp_path / "b.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_export_resizes_as_the_evaluation_transform_does(tmp_path) -> None:
    cfg = tiny_config(backbone={"img_size": 48})  # synthetic images are stored at 32 px
    meta = export_scenario(cfg, tmp_path / "r.npz")
    rt = Runtime.build(cfg)
    want = rt.env.eval_transform.resized(rt.dataset.train.images)  # float [0, 1], what the run normalises
    with np.load(tmp_path / "r.npz", allow_pickle=False) as npz:
        check_round_trip(npz, rt)
        got = torch.from_numpy(npz["train_images"])
        assert got.shape == (len(rt.dataset.train), 3, 48, 48)
        assert torch.equal(got, (want * 255).round().to(torch.uint8))  # the same resize, rounded to uint8
        assert float((got.float() / 255 - want).abs().max()) <= 0.5 / 255 + 1e-6
        assert npz["test_images"].shape[-1] == 48
    assert "bicubic from the stored 32 px to 48 px" in meta["images"]["resize"]


def test_export_of_hepco_stateless_clients_lists_each_rounds_fresh_clients(tmp_path) -> None:
    cfg = tiny_config(scenario={"num_clients": 2, "partition": {"kind": "hepco", "split_ratio": 0.5}})
    export_scenario(cfg, tmp_path / "h.npz")
    rt = Runtime.build(cfg)
    with np.load(tmp_path / "h.npz", allow_pickle=False) as npz:
        check_round_trip(npz, rt)
        assert cell(npz["participants"], npz["participants_offsets"], 0, 1).tolist() == [2, 3]


def test_cli_export_scenario_with_overrides(tmp_path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_raw()))
    assert main(["export-scenario", str(config), str(tmp_path / "x.npz"), "--set", "seed=3"]) == 0
    with np.load(tmp_path / "x.npz", allow_pickle=False) as npz:
        # the YAML lists data.options and method keys in another order: the same config, the same hash
        check_round_trip(npz, Runtime.build(tiny_config(seed=3)))
    assert config_hash(tiny_config(seed=3)) != config_hash(tiny_config(seed=4))


def test_export_refuses_an_invalid_config(tmp_path) -> None:
    from promptfcl.config import ConfigError

    with pytest.raises(ConfigError, match="method.name"):
        export_scenario(tiny_config(method={"name": "no_such_method"}), tmp_path / "x.npz")
    assert not list(Path(tmp_path).iterdir())
