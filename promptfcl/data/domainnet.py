"""DomainNet (Peng et al., ICCV 2019; http://ai.bu.edu/M3SDA/): 345 classes over six domains, three split kinds.

Layout (`data.root`, default `$PROMPTFCL_DATA/domainnet`): every domain's zip unpacked as `<root>/<domain>/<class>/
<image>.jpg`, plus the split files the split kind needs.

- `split: official` (default): the dataset's `<domain>_train.txt` / `<domain>_test.txt` ('<domain>/<class>/<image>
  <class id>' lines) of every domain in `domains`.
- `split: coda_p`: CODA-P's `domainnet_train.yaml` / `domainnet_test.yaml` (github.com/GT-RIPL/CODA-Prompt
  `dataloaders/splits/`), which Powder and C2Prompt use (methods.md §2.7). They cover five domains (clipart,
  infograph, painting, real, sketch; no quickdraw); entries of domains outside `domains` are dropped.
- `split: hepco`: HePCo's split (official code `iDOMAIN_NET.load`; methods.md §4.6): every image of every domain
  pooled, python `random.seed(0)` shuffles the indices, the first 80 % train, the rest test (not stratified).
  HePCo globs whatever domains are on disk (all six by default here). Deviations: HePCo numbers classes in glob
  (file-system) order and lists images in glob order; we use the official class order (case-insensitive
  alphabetical, as in the official files) and sort images by (domain, class, name) — reproducible, but not
  image-for-image HePCo's.

HePCo uses 5 tasks × 69 classes, C2Prompt/Powder 10 tasks × 35 classes per client (configs/hepco/, configs/c2prompt/).
Size: all six domains at 224 px are 88.3 GB of uint8 in the image cache (`promptfcl.data.cache`, on disk and
mapped, not in RAM); choose `domains` or a lower `decode_size` to shrink it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from promptfcl.data.base import DataMissingError, DatasetSpec, ImageDataset, register_dataset
from promptfcl.data.files import IMAGE_SUFFIXES, Row, check_files, file_split, names_from_rows, pooled_split, read_list
from promptfcl.data.split_files import anchor_rows, read_coda_split

DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
Domain = Literal["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
_HOW = (
    "Download the domains from http://ai.bu.edu/M3SDA/ (e.g. clipart.zip, clipart_train.txt, clipart_test.txt) and "
    "unpack them so that <root>/<domain>/<class>/<image>.jpg exist{}."
)


class DomainNetOptions(BaseModel):
    """Split kind, domains and decode resolution for DomainNet."""

    model_config = ConfigDict(extra="forbid")
    split: Literal["official", "coda_p", "hepco"] = "official"
    domains: list[Domain] = Field(default_factory=lambda: list(DOMAINS), min_length=1)
    train_list: str = Field("domainnet_train.yaml", description="coda_p: CODA-P's YAML split file")
    test_list: str = "domainnet_test.yaml"
    train_fraction: float = Field(0.8, gt=0, lt=1, description="hepco: share of the pooled images in train")
    split_seed: int = Field(0, description="hepco: python random.seed of the shuffle (HePCo: 0)")
    decode_size: int = Field(224, gt=0)

    @field_validator("domains")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("data.options.domains lists a domain twice")
        return v


def check_domainnet(root: Path, o: DomainNetOptions) -> None:
    if o.split == "official":
        files = [f"{d}_{s}.txt" for d in o.domains for s in ("train", "test")]
        check_files(root, [f"{d}/" for d in o.domains] + files, "DomainNet (official split)", _HOW.format(""))
    elif o.split == "coda_p":
        how = _HOW.format(
            f", and copy {o.train_list} / {o.test_list} from CODA-P (github.com/GT-RIPL/CODA-Prompt, "
            "dataloaders/splits/) next to them"
        )
        check_files(root, [o.train_list, o.test_list], "DomainNet (CODA-P split)", how)
    else:
        check_files(root, [f"{d}/" for d in o.domains], "DomainNet (HePCo split)", _HOW.format(""))


def _class_folders(root: Path, domains: list[str]) -> list[str]:
    names = {c.name for d in domains for c in (root / d).iterdir() if c.is_dir()}
    return sorted(names, key=lambda n: (n.lower(), n))  # the official files' class order


def _pooled_rows(root: Path, domains: list[str]) -> tuple[list[Row], list[str]]:
    names = _class_folders(root, domains)
    index = {n: i for i, n in enumerate(names)}
    rows = [
        (f"{d}/{cls}/{f.name}", index[cls])
        for d in domains
        for cls in sorted((c.name for c in (root / d).iterdir() if c.is_dir()), key=lambda n: (n.lower(), n))
        for f in sorted((root / d / cls).iterdir())
        if f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not rows:
        raise DataMissingError(f"no images under {root}/<domain>/<class>/ for domains {', '.join(domains)}")
    return rows, names


def _in_domains(rows: list[Row], domains: list[str]) -> list[Row]:
    return [r for r in rows if Path(r[0]).parts[0] in domains]


def load_domainnet(root: Path, o: DomainNetOptions, download: bool) -> ImageDataset:
    check_domainnet(root, o)
    if o.split == "hepco":
        rows, names = _pooled_rows(root, list(o.domains))
        train, test = pooled_split(rows, o.train_fraction, o.split_seed)
    else:
        if o.split == "official":
            train, test = ([r for d in o.domains for r in read_list(root / f"{d}_{s}.txt")] for s in ("train", "test"))
        else:
            train, test = (
                _in_domains(anchor_rows(root, read_coda_split(root / f), 3, ("domainnet",)), list(o.domains))
                for f in (o.train_list, o.test_list)
            )
            if not train or not test:
                raise DataMissingError(f"the CODA-P split files list no images of domains {', '.join(o.domains)}")
        names = names_from_rows(train + test, 1 + max(c for _, c in train + test))
    return ImageDataset(
        "domainnet", file_split(root, train, o.decode_size), file_split(root, test, o.decode_size), names
    )


register_dataset(
    DatasetSpec("domainnet", "domainnet", load_domainnet, check_domainnet, lambda o: 345, DomainNetOptions)
)
