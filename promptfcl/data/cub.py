"""CUB-200-2011 (Wah et al., 2011): 11,788 images of 200 bird species with the official train/test split.

Layout (`data.root`, default `$PROMPTFCL_DATA/CUB_200_2011`): the release
https://data.caltech.edu/records/65de6-vhq41 (CUB_200_2011.tgz) unpacked, i.e. `images.txt` ('<image id>
<relative path>'), `image_class_labels.txt` ('<image id> <class id, 1-based>'), `train_test_split.txt`
('<image id> <1 = train, 0 = test>'), `classes.txt` ('<class id> <nnn.Name>') and `images/<nnn.Name>/<image>.jpg`.
The official flags give 5,994 train / 5,794 test images; HGP's code (fed-mammoth `seq_cub200.py`) uses the same
official split (from a preprocessed archive). Class ids are the official ids − 1; names drop the 'nnn.' prefix.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from promptfcl.data.base import DataMissingError, DatasetSpec, ImageDataset, register_dataset
from promptfcl.data.files import check_files, file_split

_FILES = ("images.txt", "image_class_labels.txt", "train_test_split.txt", "classes.txt", "images/")


class CUBOptions(BaseModel):
    """Decode resolution for CUB-200-2011."""

    model_config = ConfigDict(extra="forbid")
    decode_size: int = Field(224, gt=0)


def check_cub(root: Path, o: CUBOptions) -> None:
    check_files(
        root,
        list(_FILES),
        "CUB-200-2011",
        "Unpack CUB_200_2011.tgz (https://data.caltech.edu/records/65de6-vhq41) and point at its CUB_200_2011/ folder.",
    )


def _pairs(path: Path) -> dict[int, str]:
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        key, _, value = line.strip().partition(" ")
        if not key.isdigit() or not value:
            raise DataMissingError(f"{path}:{n}: expected '<id> <value>', got {line!r}")
        out[int(key)] = value.strip()
    return out


def load_cub(root: Path, o: CUBOptions, download: bool) -> ImageDataset:
    check_cub(root, o)
    paths, labels, flags, classes = (_pairs(root / f) for f in _FILES[:4])
    if set(paths) != set(labels) or set(paths) != set(flags):
        raise DataMissingError(
            f"{root}: images.txt, image_class_labels.txt and train_test_split.txt list different image ids; "
            "use the files of one release"
        )
    names = [classes[k].split(".", 1)[-1] for k in sorted(classes)]
    rows = {"1": [], "0": []}
    for i in sorted(paths):
        if flags[i] not in rows or not labels[i].isdigit():
            raise DataMissingError(f"{root}: image {i} has split flag {flags[i]!r} / label {labels[i]!r}")
        rows[flags[i]].append((f"images/{paths[i]}", int(labels[i]) - 1))
    return ImageDataset(
        "cub200", file_split(root, rows["1"], o.decode_size), file_split(root, rows["0"], o.decode_size), names
    )


register_dataset(DatasetSpec("cub200", "CUB_200_2011", load_cub, check_cub, lambda o: 200, CUBOptions))
