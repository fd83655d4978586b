"""`promptfcl export-scenario CONFIG OUT.npz`: everything an external code needs to train on exactly the data of a
promptfcl run — the images as the backbone receives them, labels, class order, every client's indices per task and
round, the test indices per task, the seed and a hash of the config — in one `.npz` plus a JSON sidecar.

The dataset and scenario are built as `runtime.Runtime.build` builds them (`runtime.load_dataset`: subsampling,
then `data.cache.materialize`'s decode into the image cache; `runtime.run_scenario`), so the indices and labels are
those of a run with the same config. Images are written at the backbone's input size S: the stored uint8 images
as they are when they were decoded at S, else resized by the evaluation transform's resize (`ImageTransform.resized`,
the interpolation of `backbone.interpolation`) and rounded to uint8 — promptfcl itself keeps that resize in float,
so such an export differs from what promptfcl's backbone sees by at most half a grey level per pixel (the sidecar
says which case applies). Normalisation (`backbone.mean` / `std`) and augmentation are not applied; per-client
image domains (`scenario.domains`) are not baked in (they are in the scenario JSON).

File layout (numpy `.npz`, uncompressed, every array a plain `.npy`; ragged lists as a flat array plus offsets):

- `train_images`, `test_images`: uint8 (N, 3, S, S), RGB; `train_labels`, `test_labels`: int64 (N,), the
  dataset's class ids.
- `class_order`: int64, the classes in task order (logit j of a class-incremental run is class `class_order[j]`).
- `task_classes` + `task_classes_offsets` (L + 1,): label-space task l's classes are
  `task_classes[offsets[l]:offsets[l + 1]]`.
- `client_train` + `client_train_offsets` (T, K + 1): client k's training indices (into the train split) in
  stage t are `client_train[offsets[t, k]:offsets[t, k + 1]]`.
- `participants` + `participants_offsets` (T, R + 1): the clients that train in round r of stage t.
- `test_indices` + `test_offsets` (L + 1,): label-space task l's test indices (into the test split); a run
  evaluates after stage t on the tasks trained so far.
- `client_test` + `client_test_offsets` (T, K + 1): personalized scenarios only, each client's local test indices
  (into the train split).
- `meta_json`, `scenario_json`: uint8, UTF-8 JSON (`json.loads(npz["meta_json"].tobytes())`): the metadata below
  (also written to the sidecar `OUT.json`) and the run's complete `scenario.json`.

Writing is deterministic (fixed archive timestamps, sorted keys, no wall-clock values), so exporting the same config
again gives identical bytes; the file is written to a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import promptfcl
from promptfcl.config import ConfigError, ExperimentConfig, dump_config
from promptfcl.data import DataMissingError, ImageSplit
from promptfcl.data.cache import CacheError
from promptfcl.data.transforms import ImageTransform
from promptfcl.runtime import check_config, eval_transform, load_dataset, run_scenario
from promptfcl.scenario.scenario import Scenario

FORMAT = "promptfcl-scenario"
VERSION = 1
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # every archive member's timestamp: re-exports are byte-identical
CHUNK = 1024  # images resized and written at a time


def config_hash(cfg: ExperimentConfig) -> str:
    """SHA-256 of the validated config's dump (every default filled in) as canonical JSON (keys sorted, also inside
    free-form sections such as `data.options`), so equal configs written in another key order hash alike."""
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def ragged(rows: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of indices → (flat int64, offsets (len + 1,)): row i is flat[offsets[i]:offsets[i + 1]]."""
    lengths = [len(r) for r in rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]) if rows else np.zeros(0, np.int64)
    return flat.astype(np.int64), offsets


def ragged_grid(grid: Sequence[Sequence[Sequence[int] | np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """[t][k] → rows of indices → (flat int64, offsets (T, K + 1)) with absolute positions into flat: cell (t, k) is
    flat[offsets[t, k]:offsets[t, k + 1]] (offsets[t + 1, 0] = offsets[t, K])."""
    width = {len(row) for row in grid}
    if len(width) > 1:
        raise ValueError("every stage must list the same number of entries")
    flat, off = ragged([cell for row in grid for cell in row])
    k = width.pop() if width else 0
    offsets = np.stack([off[t * k : t * k + k + 1] for t in range(len(grid))]) if grid else np.zeros((0, k + 1))
    return flat, offsets.astype(np.int64)


def images_at(split: ImageSplit, transform: ImageTransform, chunk: int = CHUNK) -> Iterator[np.ndarray]:
    """The split's images at the transform's size as uint8 (B, 3, S, S) chunks: as stored when they already are
    S × S, else `transform.resized` (the evaluation path's resize) rounded to uint8."""
    s = transform.img_size
    for start in range(0, len(split), chunk):
        x = split.images[start : start + chunk]
        if x.shape[-2:] != (s, s):
            x = transform.resized(x).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        yield np.ascontiguousarray(x.numpy())


def _member(zf: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    return info


def _write_array(zf: zipfile.ZipFile, name: str, array: np.ndarray) -> None:
    with zf.open(_member(zf, name), "w", force_zip64=True) as f:
        np.lib.format.write_array(f, np.ascontiguousarray(array), allow_pickle=False)


def _write_chunks(
    zf: zipfile.ZipFile, name: str, shape: tuple[int, ...], dtype: np.dtype, chunks: Iterator[np.ndarray]
) -> None:
    """One `.npy` member written chunk by chunk (the images need never be in memory at once)."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    written = 0
    with zf.open(_member(zf, name), "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, header)
        for c in chunks:
            f.write(c.astype(dtype, copy=False).tobytes())
            written += len(c)
    if written != shape[0]:
        raise AssertionError(f"{name}: wrote {written} rows, expected {shape[0]}")


def _json_bytes(value: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(value, sort_keys=True, indent=1).encode(), dtype=np.uint8)


def scenario_arrays(scenario: Scenario) -> dict[str, np.ndarray]:
    """The scenario's index lists as flat arrays with offsets (the module docstring's layout)."""
    out: dict[str, np.ndarray] = {"class_order": np.asarray(scenario.class_order, dtype=np.int64)}
    out["task_classes"], out["task_classes_offsets"] = ragged(scenario.task_classes)
    out["client_train"], out["client_train_offsets"] = ragged_grid(scenario.client_train)
    out["participants"], out["participants_offsets"] = ragged_grid(scenario.participants)
    out["test_indices"], out["test_offsets"] = ragged(scenario.test_indices)
    if scenario.client_test is not None:
        out["client_test"], out["client_test_offsets"] = ragged_grid(scenario.client_test)
    return out


def metadata(cfg: ExperimentConfig, scenario: Scenario, train: ImageSplit, test: ImageSplit, names: list[str]) -> dict:
    """What the sidecar says: provenance, image convention, scenario shape and the array layout."""
    b = cfg.backbone
    stored = int(train.images.shape[-1])
    resized = stored != b.img_size or int(train.images.shape[-2]) != b.img_size
    return {
        "format": FORMAT,
        "version": VERSION,
        "promptfcl_version": promptfcl.__version__,
        "seed": cfg.seed,
        "config_sha256": config_hash(cfg),
        "config_yaml": dump_config(cfg),
        "dataset": {
            "name": cfg.data.name,
            "class_names": names,
            "train_images": len(train),
            "test_images": len(test),
        },  # fmt: skip
        "images": {
            "dtype": "uint8",
            "layout": "N x 3 x S x S, RGB, channel-first",
            "size": b.img_size,
            "stored_size": stored,
            "resize": (
                f"{b.interpolation} from the stored {stored} px to {b.img_size} px (align_corners=False, clamped to "
                "[0, 1]), as promptfcl's evaluation transform, then rounded to uint8 (promptfcl keeps the resize in "
                "float: at most half a grey level per pixel apart)"
                if resized
                else "none: the images promptfcl decoded, byte for byte"
            ),
            "normalisation_not_applied": {
                "mean": list(b.mean),
                "std": list(b.std),
                "formula": "(x / 255 - mean) / std",
            },
            "augmentation": "none applied; the run's training augmentation is the method's `augment` parameter",
            "domains": "per-client image domains are in scenario_json (client_domains), not applied"
            if scenario.domains is not None
            else None,
        },
        "scenario": {
            "kind": scenario.kind,
            "stages": scenario.num_tasks,
            "rounds_per_task": scenario.rounds_per_task,
            "num_clients": scenario.num_clients,
            "num_classes": scenario.num_classes,
            "label_space_tasks": len(scenario.task_classes),
            "upper_bound": scenario.upper_bound,
        },
        "arrays": {
            "train_images / test_images": "uint8 (N, 3, S, S)",
            "train_labels / test_labels": "int64 (N,): dataset class ids",
            "class_order": "int64: classes in task order (class-incremental logit j is class_order[j])",
            "task_classes, task_classes_offsets": "task l's classes: task_classes[off[l]:off[l+1]]",
            "client_train, client_train_offsets (T, K+1)": "client k's train indices in stage t: "
            "client_train[off[t,k]:off[t,k+1]]",
            "participants, participants_offsets (T, R+1)": "clients training in round r of stage t: "
            "participants[off[t,r]:off[t,r+1]]",
            "test_indices, test_offsets": "task l's test indices: test_indices[off[l]:off[l+1]]",
            "client_test, client_test_offsets (T, K+1)": "personalized only: local test indices into the train split",
            "meta_json, scenario_json": "uint8 UTF-8 JSON: this metadata, and the run's scenario.json",
        },
    }


def export_scenario(cfg: ExperimentConfig, out: Path, chunk: int = CHUNK) -> dict:
    """Write `out` (.npz) and its sidecar `out.with_suffix(".json")` for `cfg`; returns the metadata."""
    out = Path(out)
    check_config(cfg)
    try:
        dataset = load_dataset(cfg)
    except (DataMissingError, CacheError) as e:
        raise ConfigError(f"data: {e}") from None
    scenario = run_scenario(cfg, dataset)
    train, test = dataset.train, dataset.test
    assert isinstance(train, ImageSplit) and isinstance(test, ImageSplit)  # load_dataset decodes every split
    tf = eval_transform(cfg)
    meta = metadata(cfg, scenario, train, test, list(dataset.class_names))
    s = cfg.backbone.img_size
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, split in (("train", train), ("test", test)):
                shape = (len(split), 3, s, s)
                _write_chunks(zf, f"{name}_images", shape, np.dtype(np.uint8), images_at(split, tf, chunk))
                _write_array(zf, f"{name}_labels", split.targets.numpy().astype(np.int64))
            for name, array in scenario_arrays(scenario).items():
                _write_array(zf, name, array)
            _write_array(zf, "meta_json", _json_bytes(meta))
            _write_array(zf, "scenario_json", _json_bytes(scenario.to_json(train.targets.numpy())))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n")
    return meta
