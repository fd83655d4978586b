"""EuroSAT, RGB version (Helber et al., IGARSS 2018): 27,000 64×64 Sentinel-2 images of 10 land-use classes.

Layout (`data.root`, default `$PROMPTFCL_DATA/EuroSAT_RGB`): https://zenodo.org/records/7711810/files/
EuroSAT_RGB.zip unpacked so that `<root>/<Class>/<Class>_<n>.jpg` exist (AnnualCrop, Forest, ...).

- `split: zhou` (default): the split HGP's code uses (fed-mammoth `seq_eurosat.py` reads `EuroSAT_RGB/split.json`,
  which is Zhou et al.'s CoOp split `split_zhou_EuroSAT.json`): a JSON mapping with `train` / `val` / `test`
  lists of `[relative path, class id, class name]`; `train` (13,500) is train and `test` (8,100) is test, `val`
  is unused as in fed-mammoth. The file is looked for as `split_file`, else `split_zhou_EuroSAT.json`, else
  `split.json`. Class ids are the file's (sorted folder order); names are the folder names.
- `split: per_class`: a seeded stratified split of all images (`train_fraction` 0.8, `split_seed` 0) — our
  convention for trees without the JSON, not a paper's.

Images keep their native 64 px by default (`decode_size: 64`, fed-mammoth's input shape); the batched transform
resizes them to the backbone's input size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from promptfcl.data.base import DataMissingError, DatasetSpec, ImageDataset, register_dataset
from promptfcl.data.files import (
    Row,
    check_files,
    check_subfolders,
    file_split,
    names_from_rows,
    per_class_split,
    scan_class_folders,
)
from promptfcl.data.split_files import anchor_rows

_SPLIT_FILES = ("split_zhou_EuroSAT.json", "split.json")
_HOW = "Unpack https://zenodo.org/records/7711810/files/EuroSAT_RGB.zip so that <root>/<Class>/<image>.jpg exist{}."


class EuroSATOptions(BaseModel):
    """EuroSAT split kind (CoOp/fed-mammoth JSON or a seeded per-class split) and decode resolution."""

    model_config = ConfigDict(extra="forbid")
    split: Literal["zhou", "per_class"] = "zhou"
    split_file: str | None = Field(None, description=f"zhou: default {' or '.join(_SPLIT_FILES)}")
    train_fraction: float = Field(0.8, gt=0, lt=1, description="per_class: share of each class in train")
    split_seed: int = Field(0, description="per_class: seed of the per-class permutation")
    decode_size: int = Field(64, gt=0)


def _split_path(root: Path, o: EuroSATOptions) -> Path | None:
    names = [o.split_file] if o.split_file else list(_SPLIT_FILES)
    return next((root / n for n in names if (root / n).is_file()), None)


def check_eurosat(root: Path, o: EuroSATOptions) -> None:
    if o.split == "zhou" and _split_path(root, o) is None:
        names = [o.split_file] if o.split_file else list(_SPLIT_FILES)
        how = _HOW.format(
            ", and put Zhou et al.'s split file there (split_zhou_EuroSAT.json from the CoOp data instructions, "
            "github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md; fed-mammoth saves it as split.json), or set "
            "data.options.split: per_class"
        )
        check_files(root, [" or ".join(names)], "EuroSAT (Zhou/CoOp split)", how)
    check_subfolders(root, "<Class>/", "EuroSAT", _HOW.format(""))


def _read_zhou(path: Path) -> tuple[list[Row], list[Row]]:
    try:
        doc = json.loads(path.read_text())
        return tuple([(str(e[0]), int(e[1])) for e in doc[k]] for k in ("train", "test"))  # type: ignore[return-value]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise DataMissingError(
            f"{path}: expected the CoOp split format, a JSON object with 'train' and 'test' lists of "
            f"[relative path, class id, class name] ({type(e).__name__}: {e})"
        ) from None


def load_eurosat(root: Path, o: EuroSATOptions, download: bool) -> ImageDataset:
    check_eurosat(root, o)
    if o.split == "per_class":
        rows, names = scan_class_folders(root)
        train, test = per_class_split(rows, o.train_fraction, o.split_seed)
    else:
        path = _split_path(root, o)
        assert path is not None  # checked above
        train, test = (anchor_rows(root, rows, 2, ("EuroSAT_RGB", "2750")) for rows in _read_zhou(path))
        names = names_from_rows(train + test, 1 + max(c for _, c in train + test))
    return ImageDataset("eurosat", file_split(root, train, o.decode_size), file_split(root, test, o.decode_size), names)


register_dataset(DatasetSpec("eurosat", "EuroSAT_RGB", load_eurosat, check_eurosat, lambda o: 10, EuroSATOptions))
