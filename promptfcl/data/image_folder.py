"""Image folders listed by split files — the layout ImageNet-R, DomainNet and CUB-200 presets use.

Expected layout (`data.root`):

    <root>/train.txt        one line per image: "<relative/path.jpg> <class id>"
    <root>/test.txt         same format
    <root>/classes.txt      optional: one class name per line, in class-id order
    <root>/<relative/path.jpg> ...

Images are listed, subsampled, and the kept ones decoded once to `decode_size` squares into the image cache
(`promptfcl.data.cache`). The lists may describe a long-tailed split: `scenario.long_tail.profile: dataset` keeps it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from promptfcl.data.base import DataMissingError, DatasetSpec, ImageDataset, register_dataset
from promptfcl.data.files import file_split, read_list


class ImageFolderOptions(BaseModel):
    """Split-file names and decode resolution for an image-folder dataset."""

    model_config = ConfigDict(extra="forbid")
    train_list: str = "train.txt"
    test_list: str = "test.txt"
    classes_file: str = "classes.txt"
    decode_size: int = Field(224, gt=0)
    num_classes: int | None = Field(None, gt=0, description="default: 1 + the largest class id listed")


def check_image_folder(root: Path, o: ImageFolderOptions) -> None:
    missing = [f for f in (o.train_list, o.test_list) if not (root / f).is_file()]
    if missing:
        raise DataMissingError(
            f"image-folder dataset not found in {root}/: expected split files {o.train_list} and {o.test_list} "
            f"(lines '<relative/path.jpg> <class id>') next to the image folders; missing: {', '.join(missing)}. "
            "Set data.root to that folder."
        )


def load_image_folder(root: Path, o: ImageFolderOptions, download: bool) -> ImageDataset:
    check_image_folder(root, o)
    train_rows, test_rows = read_list(root / o.train_list), read_list(root / o.test_list)
    n = o.num_classes or 1 + max(c for _, c in train_rows + test_rows)
    names_file = root / o.classes_file
    names = names_file.read_text().splitlines()[:n] if names_file.is_file() else [f"class_{i}" for i in range(n)]
    return ImageDataset(
        root.name, file_split(root, train_rows, o.decode_size), file_split(root, test_rows, o.decode_size), names
    )


def _num_classes(o: ImageFolderOptions) -> int:
    if o.num_classes is None:
        raise ValueError("set data.options.num_classes for image_folder datasets")
    return o.num_classes


register_dataset(
    DatasetSpec(
        "image_folder",
        "image_folder",
        load_image_folder,
        check_image_folder,
        _num_classes,
        ImageFolderOptions,
        own_long_tail=True,  # the lists may describe a long-tailed split (iNaturalist, Places-LT, ...)
    )
)
