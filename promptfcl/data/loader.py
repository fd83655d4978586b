"""Index views over shared uint8 images and batching with on-device transforms."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from promptfcl.data.base import ImageSplit
from promptfcl.data.domains import ImageDomain
from promptfcl.data.transforms import ImageTransform


@dataclass
class LabeledSubset:
    """Some images of a shared split (no copy) with their targets already mapped to logit indices, and the image
    domain they are seen in (a client's fixed transform, `scenario.domains`; None: as stored)."""

    split: ImageSplit
    indices: torch.Tensor
    targets: torch.Tensor  # logit indices, aligned with `indices`
    domain: ImageDomain | None = None

    @classmethod
    def of(
        cls,
        split: ImageSplit,
        indices: np.ndarray | torch.Tensor,
        class_to_logit: torch.Tensor,
        domain: ImageDomain | None = None,
    ) -> LabeledSubset:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        targets = class_to_logit[split.targets[idx]]
        if (targets < 0).any():
            raise ValueError("subset holds images of classes outside the label space")
        return cls(split, idx, targets, domain)

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def head(self, n: int) -> LabeledSubset:
        """The first `n` samples (same split and domain)."""
        return LabeledSubset(self.split, self.indices[:n], self.targets[:n], self.domain)

    def batches(
        self,
        batch_size: int,
        transform: ImageTransform,
        generator: torch.Generator | None = None,
        shuffle: bool = False,
        device: torch.device | str = "cpu",
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, logit targets) batches; the subset's domain is applied to the stored images before `transform`;
        shuffling and augmentation draw from `generator`."""
        n = len(self)
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        for start in range(0, n, batch_size):
            sel = order[start : start + batch_size]
            images = self.split.images[self.indices[sel]].to(device, non_blocking=True)
            if self.domain is not None:
                images = self.domain(images)
            yield transform(images, generator), self.targets[sel].to(device, non_blocking=True)
