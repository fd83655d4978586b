"""Dataset adapters on tiny fake trees written here, in each release's real file formats.

Every image is a solid colour that encodes its identity, so a test can read back exactly which files landed in
train and which in test after decoding through the registry (`promptfcl.runtime.load_dataset`).
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from promptfcl.config import ConfigError, build_config
from promptfcl.experiment import check_config
from promptfcl.runtime import load_dataset

from .conftest import tiny_raw

_STEP = 20  # colour quantum: JPEG keeps a solid colour within a few levels


def _write_image(path: Path, ident: int) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    color = (_STEP * (ident % 12), _STEP * (ident // 12 % 12), 200)
    fmt = "PNG" if path.suffix.lower() == ".png" else "JPEG"
    Image.new("RGB", (6, 5), color).save(path, format=fmt, quality=100)


def _ids(split: Any) -> list[int]:
    px = split.images[:, :, 0, 0].int()
    return [round(int(r) / _STEP) + 12 * round(int(g) / _STEP) for r, g in zip(px[:, 0], px[:, 1], strict=True)]


def _tree(root: Path, rels: list[str]) -> dict[str, int]:
    """Write one image per relative path; return path -> identity."""
    ident = {}
    for i, rel in enumerate(rels):
        _write_image(root / rel, i)
        ident[rel] = i
    return ident


def _load(name: str, root: Path, **options: Any):
    raw = tiny_raw()
    raw["data"] = {"name": name, "root": str(root), "options": options}
    return load_dataset(build_config(raw))


def _by_class(split: Any) -> dict[int, int]:
    return {int(c): int(n) for c, n in zip(*np.unique(split.targets.numpy(), return_counts=True), strict=True)}


WNIDS = ["n01443537", "n01484850", "n01494475"]


def _imagenet_r(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    root = tmp_path / "imagenet-r"
    rels = [f"{w}/{style}_{k}.jpg" for w in WNIDS for style, k in [("art", 0), ("cartoon", 1), ("sketch", 2)]]
    rels += [f"{w}/toy_{k}.jpg" for w in WNIDS for k in range(2)]
    return root, _tree(root, rels)


def test_imagenet_r_coda_p_yaml_split(tmp_path: Path) -> None:
    root, ident = _imagenet_r(tmp_path)
    # CODA-P's files list paths as they were on the authors' machine (with train/ or test/ folders in them)
    test_rels = [f"{w}/toy_1.jpg" for w in WNIDS] + [f"{WNIDS[0]}/art_0.jpg"]
    train_rels = [r for r in ident if r not in test_rels]
    for name, rels, prefix in [("train", train_rels, "train"), ("test", test_rels, "test")]:
        doc = {"data": [f"data/imagenet-r/{prefix}/{r}" for r in rels], "targets": [WNIDS.index(r[:9]) for r in rels]}
        (root / f"imagenet-r_{name}.yaml").write_text(yaml.safe_dump(doc))
    ds = _load("imagenet_r", root, decode_size=4)
    assert ds.class_names == WNIDS
    assert sorted(_ids(ds.train)) == sorted(ident[r] for r in train_rels)
    assert sorted(_ids(ds.test)) == sorted(ident[r] for r in test_rels)
    assert ds.train.images.shape[1:] == (3, 4, 4) and _by_class(ds.test) == {0: 2, 1: 1, 2: 1}
    for i, t in zip(_ids(ds.train), ds.train.targets.tolist(), strict=True):  # every image keeps its listed class
        assert WNIDS[t] == next(r for r, k in ident.items() if k == i)[:9]

    # a tree unpacked with DualPrompt's train/ and test/ sub-folders: paths are re-anchored after 'imagenet-r/'
    dual = tmp_path / "dual" / "imagenet-r"
    moved = _tree(dual, [f"{'test' if r in test_rels else 'train'}/{r}" for r in ident])
    for name in ("train", "test"):
        (dual / f"imagenet-r_{name}.yaml").write_text((root / f"imagenet-r_{name}.yaml").read_text())
    ds_dual = _load("imagenet_r", dual, decode_size=4)
    assert sorted(_ids(ds_dual.test)) == sorted(moved[f"test/{r}"] for r in test_rels)

    # '<path> <id>' text lists instead of the YAML files
    (root / "tr.txt").write_text("".join(f"{r} {WNIDS.index(r[:9])}\n" for r in train_rels))
    (root / "te.txt").write_text("".join(f"{r} {WNIDS.index(r[:9])}\n" for r in test_rels))
    ds2 = _load("imagenet_r", root, decode_size=4, train_list="tr.txt", test_list="te.txt")
    assert _ids(ds2.train) == _ids(ds.train) and _ids(ds2.test) == _ids(ds.test)


def test_imagenet_r_hepco_pooled_seeded_split(tmp_path: Path) -> None:
    root, ident = _imagenet_r(tmp_path)
    ds = _load("imagenet_r", root, split="hepco", decode_size=4)
    n = len(ident)
    assert ds.class_names == WNIDS and len(ds.train) == int(0.8 * n) and len(ds.test) == n - int(0.8 * n)
    # HePCo's code: classes in wnid order, random.seed(0); random.shuffle(indices); first 80 % train
    pooled = sorted(ident)  # class folders sorted, images sorted within a class
    order = list(range(n))
    random.seed(0)
    random.shuffle(order)
    assert _ids(ds.train) == [ident[pooled[i]] for i in order[: int(0.8 * n)]]
    assert set(_ids(ds.train)).isdisjoint(_ids(ds.test)) and len(set(_ids(ds.train) + _ids(ds.test))) == n
    again = _load("imagenet_r", root, split="hepco", decode_size=4)
    assert _ids(again.train) == _ids(ds.train)
    other = _load("imagenet_r", root, split="hepco", split_seed=1, decode_size=4)
    assert set(_ids(other.test)) != set(_ids(ds.test))


def test_imagenet_a_folders_and_seeded_per_class_split(tmp_path: Path) -> None:
    root = tmp_path / "imagenet-a"
    ident = _tree(
        root, [f"{s}/{w}/{k}.jpg" for s, per in [("train", 3), ("test", 1)] for w in WNIDS for k in range(per)]
    )
    ds = _load("imagenet_a", root, decode_size=4)
    assert (
        ds.class_names == WNIDS
        and _by_class(ds.train) == {0: 3, 1: 3, 2: 3}
        and _by_class(ds.test) == {0: 1, 1: 1, 2: 1}
    )
    assert sorted(_ids(ds.test)) == sorted(v for k, v in ident.items() if k.startswith("test/"))

    raw = tmp_path / "raw"
    ident = _tree(raw, [f"{w}/{k}.jpg" for w in WNIDS for k in range(5)])
    a = _load("imagenet_a", raw, split="per_class", decode_size=4)
    assert _by_class(a.train) == {0: 4, 1: 4, 2: 4} and _by_class(a.test) == {0: 1, 1: 1, 2: 1}
    assert set(_ids(a.train)).isdisjoint(_ids(a.test)) and len(set(_ids(a.train) + _ids(a.test))) == 15
    assert _ids(_load("imagenet_a", raw, split="per_class", decode_size=4).test) == _ids(a.test)
    assert _ids(_load("imagenet_a", raw, split="per_class", split_seed=1, decode_size=4).test) != _ids(a.test)


DN_CLASSES = ["aircraft_carrier", "The_Eiffel_Tower", "zebra"]  # official order: case-insensitive alphabetical


def _domainnet(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    root = tmp_path / "domainnet"
    rels = [
        f"{d}/{c}/{d}_{i:03d}_{k:06d}.jpg"
        for d in ("clipart", "sketch")
        for i, c in enumerate(DN_CLASSES)
        for k in range(3)
    ]
    return root, _tree(root, rels)


def test_domainnet_official_split_and_domains(tmp_path: Path) -> None:
    root, ident = _domainnet(tmp_path)
    split = {r: ("test" if r.endswith("000002.jpg") else "train") for r in ident}
    for d in ("clipart", "sketch"):
        for s in ("train", "test"):
            lines = [f"{r} {DN_CLASSES.index(r.split('/')[1])}\n" for r in ident if r.startswith(d) and split[r] == s]
            (root / f"{d}_{s}.txt").write_text("".join(lines))
    with pytest.raises(ConfigError, match="quickdraw_train.txt"):  # default: all six domains
        check_config(_cfg("domainnet", root))
    ds = _load("domainnet", root, domains=["clipart", "sketch"], decode_size=4)
    assert ds.class_names == DN_CLASSES
    assert sorted(_ids(ds.test)) == sorted(v for r, v in ident.items() if split[r] == "test")
    sk = _load("domainnet", root, domains=["sketch"], decode_size=4)
    assert sorted(_ids(sk.train)) == sorted(
        v for r, v in ident.items() if r.startswith("sketch") and split[r] == "train"
    )


def test_domainnet_coda_p_and_hepco_splits(tmp_path: Path) -> None:
    root, ident = _domainnet(tmp_path)
    rels = sorted(ident)
    train, test = rels[::2], rels[1::2]
    for name, part in [("train", train), ("test", test + ["quickdraw/zebra/quickdraw_344_000001.jpg"])]:
        doc = {"data": [f"/shared/sets/datasets/DomainNet/{r}" for r in part], "targets": [0] * len(part)}
        doc["targets"] = [DN_CLASSES.index(r.split("/")[1]) if "quickdraw" not in r else 344 for r in part]
        (root / f"domainnet_{name}.yaml").write_text(yaml.safe_dump(doc))
    ds = _load("domainnet", root, split="coda_p", domains=["clipart", "sketch"], decode_size=4)
    assert sorted(_ids(ds.train)) == sorted(ident[r] for r in train)
    assert sorted(_ids(ds.test)) == sorted(ident[r] for r in test)  # the quickdraw entry is outside the domains

    h = _load("domainnet", root, split="hepco", domains=["clipart", "sketch"], decode_size=4)
    assert h.class_names == DN_CLASSES and len(h.train) == int(0.8 * 18)
    assert set(_ids(h.train)).isdisjoint(_ids(h.test))
    assert _ids(_load("domainnet", root, split="hepco", domains=["clipart", "sketch"], decode_size=4).test) == _ids(
        h.test
    )


EURO = ["AnnualCrop", "Forest", "River"]


def test_eurosat_zhou_split_and_per_class(tmp_path: Path) -> None:
    root = tmp_path / "EuroSAT_RGB"
    ident = _tree(root, [f"{c}/{c}_{k}.jpg" for c in EURO for k in range(1, 6)])
    part = {1: "train", 2: "train", 3: "val", 4: "test", 5: "test"}
    doc = {
        s: [[r, EURO.index(r.split("/")[0]), r.split("/")[0]] for r in ident if part[int(r[-5])] == s]
        for s in ("train", "val", "test")
    }
    with pytest.raises(ConfigError, match="split_zhou_EuroSAT.json or split.json"):
        check_config(_cfg("eurosat", root))
    (root / "split_zhou_EuroSAT.json").write_text(json.dumps(doc))
    ds = _load("eurosat", root, decode_size=4)
    assert ds.class_names == EURO and len(ds.train) == 6 and len(ds.test) == 6  # val is unused, as in fed-mammoth
    assert sorted(_ids(ds.test)) == sorted(v for r, v in ident.items() if part[int(r[-5])] == "test")
    p = _load("eurosat", root, split="per_class", decode_size=4)
    assert _by_class(p.train) == {0: 4, 1: 4, 2: 4} and set(_ids(p.train)).isdisjoint(_ids(p.test))


def test_cars196_devkit_mat_files_and_folders(tmp_path: Path) -> None:
    savemat = pytest.importorskip("scipy.io", reason="the Cars devkit test needs scipy (promptfcl[dev])").savemat

    root = tmp_path / "stanford_cars"
    train = [(f"{k:05d}.jpg", 1 + k % 3) for k in range(1, 7)]
    test = [(f"{k:05d}.jpg", 1 + k % 3) for k in range(1, 4)]
    ident = _tree(root, [f"cars_train/{f}" for f, _ in train] + [f"cars_test/{f}" for f, _ in test])
    fields = [(n, "O") for n in ("bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "fname")]

    def annos(rows: list[tuple[str, int]]) -> np.ndarray:
        return np.array([(0, 0, 5, 4, c, f) for f, c in rows], dtype=fields)

    (root / "devkit").mkdir()
    savemat(root / "devkit" / "cars_train_annos.mat", {"annotations": annos(train)})
    savemat(root / "cars_test_annos_withlabels.mat", {"annotations": annos(test)})
    names = ["AM General Hummer SUV 2000", "Acura RL Sedan 2012", "Acura TL Sedan 2012"]
    with pytest.raises(ConfigError, match="devkit/cars_meta.mat"):
        check_config(_cfg("cars196", root))
    savemat(root / "devkit" / "cars_meta.mat", {"class_names": np.array(names, dtype=object)})
    ds = _load("cars196", root, decode_size=4)
    assert ds.class_names == names
    assert sorted(zip(_ids(ds.train), ds.train.targets.tolist(), strict=True)) == sorted(
        (ident[f"cars_train/{f}"], c - 1) for f, c in train
    )
    assert sorted(_ids(ds.test)) == sorted(ident[f"cars_test/{f}"] for f, _ in test)

    folders = tmp_path / "car_data"
    _tree(folders, [f"{s}/{n}/{k}.jpg" for s in ("train", "test") for n in names for k in range(2)])
    f = _load("cars196", folders, layout="folders", decode_size=4)
    assert f.class_names == sorted(names) and _by_class(f.test) == {0: 2, 1: 2, 2: 2}


def test_cub200_obeys_train_test_split_flags(tmp_path: Path) -> None:
    root = tmp_path / "CUB_200_2011"
    classes = ["001.Black_footed_Albatross", "002.Laysan_Albatross", "003.Sooty_Albatross"]
    rels = [f"{c}/{c.split('.')[1]}_{k:04d}.jpg" for c in classes for k in range(3)]
    ident = _tree(root / "images", rels)
    flags = {i: int(i % 3 != 0) for i in range(1, len(rels) + 1)}  # image ids 3, 6, 9 are test
    (root / "images.txt").write_text("".join(f"{i} {r}\n" for i, r in enumerate(rels, 1)))
    (root / "image_class_labels.txt").write_text("".join(f"{i} {1 + (i - 1) // 3}\n" for i in range(1, 10)))
    (root / "classes.txt").write_text("".join(f"{i} {c}\n" for i, c in enumerate(classes, 1)))
    with pytest.raises(ConfigError, match=r"missing: train_test_split\.txt"):
        check_config(_cfg("cub200", root))
    (root / "train_test_split.txt").write_text("".join(f"{i} {f}\n" for i, f in flags.items()))
    ds = _load("cub200", root, decode_size=4)
    assert ds.class_names == ["Black_footed_Albatross", "Laysan_Albatross", "Sooty_Albatross"]
    assert sorted(_ids(ds.test)) == sorted(ident[rels[i - 1]] for i, f in flags.items() if f == 0)
    assert ds.train.targets.tolist() == [0, 0, 1, 1, 2, 2] and ds.test.targets.tolist() == [0, 1, 2]


def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def test_fashion_mnist_idx_files_gzipped_or_raw(tmp_path: Path) -> None:
    root = tmp_path / "fashion-mnist"
    rng = np.random.default_rng(0)
    data = {p: (rng.integers(0, 256, (n, 28, 28)), rng.integers(0, 10, n)) for p, n in [("train", 7), ("t10k", 3)]}
    (root / "raw").mkdir(parents=True)
    for p, (x, y) in data.items():
        (root / f"{p}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(x)))
        (root / "raw" / f"{p}-labels-idx1-ubyte").write_bytes(_idx(y))  # torchvision keeps raw/ files unzipped
    ds = _load("fashion_mnist", root)
    assert ds.class_names[0] == "T-shirt/top" and len(ds.class_names) == 10
    assert ds.train.images.shape == (7, 3, 28, 28) and ds.test.images.shape == (3, 3, 28, 28)
    assert (
        np.array_equal(ds.train.images[:, 1].numpy(), data["train"][0])
        and (ds.train.images[:, 0] == ds.train.images[:, 2]).all()
    )
    assert ds.test.targets.tolist() == data["t10k"][1].tolist()
    (root / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(data["t10k"][0])[:-5]))
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        _load_checked("fashion_mnist", root)


def test_imagenet_lt_standard_split_files(tmp_path: Path) -> None:
    root = tmp_path / "imagenet"
    train = [f"train/{w}/{w}_{k}.JPEG" for i, w in enumerate(WNIDS) for k in range(4 - i)]  # long-tailed counts
    test = [f"val/{w}/ILSVRC2012_val_{i:08d}.JPEG" for i, w in enumerate(WNIDS)]
    ident = _tree(root, train + test)
    (root / "ImageNet_LT_train.txt").write_text("".join(f"{r} {WNIDS.index(r.split('/')[1])}\n" for r in train))
    with pytest.raises(ConfigError, match="ImageNet_LT_test.txt"):
        check_config(_cfg("imagenet_lt", root))
    (root / "ImageNet_LT_test.txt").write_text("".join(f"{r} {WNIDS.index(r.split('/')[1])}\n" for r in test))
    ds = _load("imagenet_lt", root, decode_size=4)
    assert ds.class_names == WNIDS and _by_class(ds.train) == {0: 4, 1: 3, 2: 2}
    assert sorted(_ids(ds.test)) == sorted(ident[r] for r in test)


def _cfg(name: str, root: Path, **options: Any):
    raw = tiny_raw()
    raw["data"] = {"name": name, "root": str(root), "options": options}
    return build_config(raw)


def _load_checked(name: str, root: Path, **options: Any):
    from promptfcl.runtime import Runtime

    return Runtime.build(_cfg(name, root, **options))


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("imagenet_r", {}, ["imagenet-r_train.yaml", "CODA-Prompt", "imagenet-r.tar"]),
        ("imagenet_r", {"split": "hepco"}, ["<wnid>/", "imagenet-r.tar"]),
        ("imagenet_a", {}, ["train/, test/", "imagenet-a.tar"]),
        ("domainnet", {"split": "coda_p"}, ["domainnet_train.yaml", "M3SDA"]),
        ("domainnet", {"split": "hepco", "domains": ["real"]}, ["missing: real/"]),
        ("eurosat", {"split": "per_class"}, ["<Class>/", "EuroSAT_RGB.zip"]),
        ("cars196", {"layout": "folders"}, ["train/, test/"]),
        ("cub200", {}, ["images.txt", "image_class_labels.txt", "train_test_split.txt", "CUB_200_2011.tgz"]),
        ("fashion_mnist", {}, ["train-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "zalandoresearch"]),
        ("imagenet_lt", {}, ["ImageNet_LT_train.txt", "val/"]),
    ],
)
def test_absent_trees_name_the_expected_layout(tmp_path: Path, name: str, options: dict, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        check_config(_cfg(name, tmp_path / "absent", **options))
    msg = str(e.value)
    assert msg.startswith("data: ") and str(tmp_path / "absent") in msg and "data.root" in msg
    for text in expected:
        assert text in msg


def test_split_file_and_tree_disagreements_are_refused(tmp_path: Path) -> None:
    only_splits = tmp_path / "splits_only"
    only_splits.mkdir()
    for name in ("train", "test"):
        (only_splits / f"imagenet-r_{name}.yaml").write_text(yaml.safe_dump({"data": [], "targets": []}))
    with pytest.raises(ConfigError, match=r"missing: <wnid>/\)\..*imagenet-r\.tar"):
        check_config(_cfg("imagenet_r", only_splits))
    tree, _ = _imagenet_r(only_splits)
    for name in ("train", "test"):
        (tree / f"imagenet-r_{name}.yaml").write_text(yaml.safe_dump({"data": [], "targets": []}))
    with pytest.raises(ConfigError, match="imagenet-r_train.yaml lists no images"):
        _load_checked("imagenet_r", tree, decode_size=4)
    root, ident = _imagenet_r(tmp_path)
    rels = sorted(ident)
    doc = {"data": rels, "targets": [0] * len(rels)}  # one class id for images of three wnid folders
    (root / "imagenet-r_train.yaml").write_text(yaml.safe_dump(doc))
    (root / "imagenet-r_test.yaml").write_text(yaml.safe_dump({"data": rels[:1], "targets": [0]}))
    with pytest.raises(ConfigError, match="does not match the image tree"):
        _load_checked("imagenet_r", root, decode_size=4)
    (root / "imagenet-r_train.yaml").write_text(yaml.safe_dump({"data": rels, "targets": [0]}))
    with pytest.raises(ConfigError, match="equally long"):
        _load_checked("imagenet_r", root, decode_size=4)
    (root / "imagenet-r_train.yaml").write_text(yaml.safe_dump({"data": ["n01443537/gone.jpg"], "targets": [0]}))
    with pytest.raises(ConfigError, match="gone.jpg is listed in the split file but does not exist"):
        _load_checked("imagenet_r", root, decode_size=4)


def test_shipped_configs_name_valid_dataset_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every preset's data section names a registered dataset with options its model accepts, and its scenario
    fits that dataset's class count (runtime's data check, minus the file check: `download` skips it)."""
    from promptfcl.config import load_config
    from promptfcl.runtime import _check_data, resolve_dataset_options

    monkeypatch.setenv("PROMPTFCL_ASSETS", "/assets")
    monkeypatch.setenv("PROMPTFCL_DATA", "/data")
    root = Path(__file__).resolve().parents[1] / "configs"
    used = set()
    for path in sorted(p for p in root.rglob("*.yaml") if "papers" not in p.parts):
        cfg = load_config(path)
        spec, _ = resolve_dataset_options(cfg)
        used.add(spec.name)
        _check_data(cfg.model_copy(update={"data": cfg.data.model_copy(update={"download": True})}))
    assert {"imagenet_r", "domainnet", "imagenet_a", "eurosat", "cars196", "cub200", "fashion_mnist"} <= used
