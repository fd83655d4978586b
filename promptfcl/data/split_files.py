"""Published split files that list images by path: CODA-P's YAML splits and plain '<path> <class id>' lists.

CODA-P (Smith et al., CVPR 2023; github.com/GT-RIPL/CODA-Prompt, `dataloaders/splits/`) ships
`imagenet-r_{train,test}.yaml` and `domainnet_{train,test}.yaml`: a mapping with `data` (image paths as they were
on the authors' machine, e.g. `data/imagenet-r/train/n01910747/tattoo_75.jpg` or
`/shared/.../DomainNet/painting/mouse/painting_192_000378.jpg`) and `targets` (class ids). HGP (fed-mammoth),
Powder and C2Prompt use these files. We re-anchor every path on the local tree by its last `keep` components
(`<wnid>/<image>` for ImageNet-R, `<domain>/<class>/<image>` for DomainNet), falling back to the part after the
dataset's folder name (for trees unpacked with train/ and test/ sub-folders).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from promptfcl.data.base import DataMissingError
from promptfcl.data.files import Row, read_list


def _load_yaml(path: Path) -> object:
    import yaml

    try:
        with path.open() as f:
            if hasattr(yaml, "CSafeLoader"):  # the C loader parses the 24k-entry lists ~10x faster
                return yaml.load(f, Loader=yaml.CSafeLoader)
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise DataMissingError(f"{path} is not a readable YAML split file: {e}") from None


def read_coda_split(path: Path) -> list[Row]:
    """Rows (path as written, class id) of a CODA-P YAML split file."""
    doc = _load_yaml(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list) or not isinstance(doc.get("targets"), list):
        raise DataMissingError(f"{path}: expected CODA-P's split format, a mapping with lists 'data' and 'targets'")
    data, targets = doc["data"], doc["targets"]
    if len(data) != len(targets) or not all(isinstance(t, int) for t in targets):
        raise DataMissingError(f"{path}: 'data' and 'targets' must be equally long and 'targets' integer class ids")
    if not data:
        raise DataMissingError(f"{path} lists no images")
    return [(str(p), int(t)) for p, t in zip(data, targets, strict=True)]


def read_split_file(path: Path) -> list[Row]:
    """A CODA-P YAML split (`.yaml` / `.yml`) or a '<relative path> <class id>' list (anything else)."""
    return read_coda_split(path) if path.suffix.lower() in (".yaml", ".yml") else read_list(path)


def anchor_rows(root: Path, rows: list[Row], keep: int, folder_names: tuple[str, ...]) -> list[Row]:
    """Paths of published split files made relative to `root`.

    A relative path that exists under `root` is kept; otherwise its last `keep` components are used (or, if that
    file does not exist either, the part after the last component named like one of `folder_names`). Missing
    files are reported by the decoder with the path tried.
    """
    lowered = {n.lower() for n in folder_names}
    out = []
    for rel, c in rows:
        p = PurePosixPath(rel.replace("\\", "/"))
        if not p.is_absolute() and (root / p).is_file():
            out.append((str(p), c))
            continue
        tail = PurePosixPath(*p.parts[-keep:])
        if not (root / tail).is_file():
            cut = [i for i, part in enumerate(p.parts) if part.lower() in lowered]
            if cut and (root / PurePosixPath(*p.parts[cut[-1] + 1 :])).is_file():
                tail = PurePosixPath(*p.parts[cut[-1] + 1 :])
        out.append((str(tail), c))
    return out
