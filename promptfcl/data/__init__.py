"""Datasets (registry, decoders) and batched transforms."""

from promptfcl.data import (  # noqa: F401  (register datasets)
    cars,
    cifar,
    cub,
    domainnet,
    eurosat,
    fashion_mnist,
    image_folder,
    imagenet,
    synthetic,
)
from promptfcl.data.base import (
    DATASETS,
    DataMissingError,
    DatasetSpec,
    ImageDataset,
    ImageSplit,
    resolve_root,
    subsample_per_class,
)
from promptfcl.data.transforms import ImageTransform

__all__ = [
    "DATASETS",
    "DataMissingError",
    "DatasetSpec",
    "ImageDataset",
    "ImageSplit",
    "ImageTransform",
    "resolve_root",
    "subsample_per_class",
]
