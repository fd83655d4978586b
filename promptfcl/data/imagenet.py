"""ImageNet-R, ImageNet-A and ImageNet-LT, each with the split convention of the papers that use it.

**ImageNet-R** (`imagenet_r`, 200 classes; Hendrycks et al. 2021, https://people.eecs.berkeley.edu/~hendrycks/
imagenet-r.tar unpacked so that `<root>/<wnid>/<image>.jpg`):

- `split: coda_p` (default): CODA-P's published split, `imagenet-r_train.yaml` / `imagenet-r_test.yaml` from
  github.com/GT-RIPL/CODA-Prompt `dataloaders/splits/` copied into `<root>/` (24,000 / 6,000 images, class ids as
  listed). HGP (fed-mammoth `seq_imagenetr.py`), Powder and C2Prompt use these files (methods.md §2.7, §5.7).
  `train_list` / `test_list` may instead name '<relative path> <class id>' text lists.
- `split: hepco`: HePCo's split (official code `dataloaders/dataloader.py`, `iIMAGENET_R.load`; methods.md §4.6):
  all images pooled, python `random.seed(0)` shuffles the indices, the first 80 % train, the rest test — *not*
  stratified by class. Class ids follow HePCo's `imr_classnames` order, which is ImageNet's (= sorted wnid) order.
  Deviation: HePCo lists images with `glob` (file-system order, not reproducible across machines); we sort the
  images of each class by name, so the split is reproducible but not image-for-image HePCo's.

**ImageNet-A** (`imagenet_a`, 200 classes; Hendrycks et al. 2021): HGP's paper gives no split rule; its code
(fed-mammoth `seq_imageneta.py`) reads a pre-split archive, `<root>/train/<wnid>/` and `<root>/test/<wnid>/`
(torchvision `ImageFolder`, class ids = sorted wnids) — `split: folders` (default) reads that layout. For the raw
release (`<root>/<wnid>/`), `split: per_class` draws a seeded stratified `train_fraction` (0.8) split per class
with `split_seed` (0) — our convention, stated here because the paper states none.

**ImageNet-LT** (`imagenet_lt`, 1000 classes; Liu et al. CVPR 2019, used by CAPT §4.1): the standard split files
`ImageNet_LT_train.txt` (115,846 images, 5-1,280 per class) and `ImageNet_LT_test.txt` (50,000, balanced) with
'<path> <class id>' lines (`train/n01440764/....JPEG 0`, `val/n01440764/....JPEG 0`) next to the ImageNet
`train/` and `val/` folders (val sorted into wnid folders). Class names are the wnids.

All three list their files; the run decodes the images it keeps once to `decode_size` (224) squares in the image
cache (`promptfcl.data.cache`): ImageNet-R takes 4.5 GB on disk at 224 px, ImageNet-LT 25.0 GB (lower
`decode_size` for a smaller footprint; the transform resizes to the backbone). ImageNet-LT's training split is
long-tailed as released: `scenario.long_tail.profile: dataset` keeps its class counts (CAPT's ImageNet-LT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from promptfcl.data.base import DataMissingError, DatasetSpec, ImageDataset, register_dataset
from promptfcl.data.files import (
    check_files,
    check_subfolders,
    file_split,
    names_from_rows,
    per_class_split,
    pooled_split,
    scan_class_folders,
)
from promptfcl.data.split_files import anchor_rows, read_split_file

_IMR_HOW = (
    "Unpack https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar so that <root>/<wnid>/<image>.jpg exist{}."
)


class ImageNetROptions(BaseModel):
    """Which ImageNet-R split (CODA-P's files or HePCo's seeded 80/20) and the decode resolution."""

    model_config = ConfigDict(extra="forbid")
    split: Literal["coda_p", "hepco"] = "coda_p"
    train_list: str = Field("imagenet-r_train.yaml", description="coda_p: CODA-P YAML or a '<path> <id>' list")
    test_list: str = "imagenet-r_test.yaml"
    train_fraction: float = Field(0.8, gt=0, lt=1, description="hepco: share of the pooled images in train")
    split_seed: int = Field(0, description="hepco: python random.seed of the shuffle (HePCo: 0)")
    decode_size: int = Field(224, gt=0)


def check_imagenet_r(root: Path, o: ImageNetROptions) -> None:
    if o.split == "coda_p":
        how = _IMR_HOW.format(
            f", and copy {o.train_list} / {o.test_list} from CODA-P (github.com/GT-RIPL/CODA-Prompt, "
            "dataloaders/splits/) next to them, or name '<path> <class id>' lists in data.options.train_list/test_list"
        )
        check_files(root, [o.train_list, o.test_list], "ImageNet-R (CODA-P split)", how)
    check_subfolders(root, "<wnid>/", f"ImageNet-R ({o.split} split)", _IMR_HOW.format(""))


def load_imagenet_r(root: Path, o: ImageNetROptions, download: bool) -> ImageDataset:
    check_imagenet_r(root, o)
    if o.split == "hepco":
        rows, names = scan_class_folders(root)
        train, test = pooled_split(rows, o.train_fraction, o.split_seed)
    else:
        train, test = (
            anchor_rows(root, read_split_file(root / f), 2, ("imagenet-r",)) for f in (o.train_list, o.test_list)
        )
        names = names_from_rows(train + test, 1 + max(c for _, c in train + test))
    return ImageDataset(
        "imagenet_r", file_split(root, train, o.decode_size), file_split(root, test, o.decode_size), names
    )


class ImageNetAOptions(BaseModel):
    """ImageNet-A layout (fed-mammoth's train/ and test/ folders, or a seeded per-class split of the release)."""

    model_config = ConfigDict(extra="forbid")
    split: Literal["folders", "per_class"] = "folders"
    train_fraction: float = Field(0.8, gt=0, lt=1, description="per_class: share of each class in train")
    split_seed: int = Field(0, description="per_class: seed of the per-class permutation")
    decode_size: int = Field(224, gt=0)


def check_imagenet_a(root: Path, o: ImageNetAOptions) -> None:
    if o.split == "folders":
        check_files(
            root,
            ["train/", "test/"],
            "ImageNet-A (fed-mammoth's train/test split)",
            "Put the split as <root>/train/<wnid>/*.jpg and <root>/test/<wnid>/*.jpg (the archive HGP's code uses), "
            "or unpack the release https://people.eecs.berkeley.edu/~hendrycks/imagenet-a.tar as <root>/<wnid>/ "
            "and set data.options.split: per_class.",
        )
    else:
        how = "Unpack https://people.eecs.berkeley.edu/~hendrycks/imagenet-a.tar so that <root>/<wnid>/*.jpg exist."
        check_subfolders(root, "<wnid>/", "ImageNet-A", how)


def load_imagenet_a(root: Path, o: ImageNetAOptions, download: bool) -> ImageDataset:
    check_imagenet_a(root, o)
    if o.split == "per_class":
        rows, names = scan_class_folders(root)
        train, test = per_class_split(rows, o.train_fraction, o.split_seed)
        base_train = base_test = root
    else:
        train, names = scan_class_folders(root / "train")
        test_rows, test_names = scan_class_folders(root / "test")
        unknown = sorted(set(test_names) - set(names))
        if unknown:
            raise DataMissingError(f"{root}/test/ has classes absent from {root}/train/: {', '.join(unknown[:5])}")
        index = {n: i for i, n in enumerate(names)}
        test = [(rel, index[test_names[c]]) for rel, c in test_rows]
        base_train, base_test = root / "train", root / "test"
    return ImageDataset(
        "imagenet_a", file_split(base_train, train, o.decode_size), file_split(base_test, test, o.decode_size), names
    )


class ImageNetLTOptions(BaseModel):
    """ImageNet-LT split-file names and the decode resolution."""

    model_config = ConfigDict(extra="forbid")
    train_list: str = "ImageNet_LT_train.txt"
    test_list: str = "ImageNet_LT_test.txt"
    decode_size: int = Field(224, gt=0)


def check_imagenet_lt(root: Path, o: ImageNetLTOptions) -> None:
    check_files(
        root,
        [o.train_list, o.test_list, "train/", "val/"],
        "ImageNet-LT",
        "Put the ILSVRC-2012 train/ and val/ folders (val sorted into <wnid>/ folders) there with the standard "
        "split files of Liu et al. (github.com/zhmiao/OpenLongTailRecognition-OLTR, ImageNet_LT_*.txt).",
    )


def load_imagenet_lt(root: Path, o: ImageNetLTOptions, download: bool) -> ImageDataset:
    check_imagenet_lt(root, o)
    train, test = read_split_file(root / o.train_list), read_split_file(root / o.test_list)
    names = names_from_rows(train + test, 1 + max(c for _, c in train + test))
    return ImageDataset(
        "imagenet_lt", file_split(root, train, o.decode_size), file_split(root, test, o.decode_size), names
    )


register_dataset(
    DatasetSpec("imagenet_r", "imagenet-r", load_imagenet_r, check_imagenet_r, lambda o: 200, ImageNetROptions)
)
register_dataset(
    DatasetSpec("imagenet_a", "imagenet-a", load_imagenet_a, check_imagenet_a, lambda o: 200, ImageNetAOptions)
)
register_dataset(
    DatasetSpec(
        "imagenet_lt",
        "imagenet",
        load_imagenet_lt,
        check_imagenet_lt,
        lambda o: 1000,
        ImageNetLTOptions,
        own_long_tail=True,
    )
)
