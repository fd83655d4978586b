"""Index views over shared uint8 images and batching with on-device transforms; the batch size of no-grad passes.

`nograd_batch(device, requested)` is the batch every no-grad pass over client or test data runs at (evaluation,
class statistics, LoRM's Grams, the prompt-effect pass, C2Prompt's and Powder's feature passes): `engine.nograd_batch`
when set (`set_nograd_batch`, called by `runtime.Runtime.build` for its process), else per device — on the CPU
`CPU_NOGRAD_BATCH[torch threads]`, the fastest batch of the hybrid backbone's forward at that thread count as
measured by `benchmarks/nograd_batch.py` (`benchmarks/results/nograd_batch.json`; more threads than measured use the
largest count measured), elsewhere the pass's own size (`eval.batch_size` for evaluation, 128 for statistics and
Grams), as before. A no-grad pass's values do not depend on its batching beyond float summation order
(`tests/test_nograd_batch.py`), so this is a speed setting only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from promptfcl.data.base import ImageSplit
from promptfcl.data.domains import ImageDomain
from promptfcl.data.transforms import ImageTransform

# torch threads → the CPU batch that ran the hybrid's forward fastest (benchmarks/results/nograd_batch.json)
CPU_NOGRAD_BATCH: dict[int, int] = {1: 32, 2: 256}
_nograd_override: int | None = None


def cpu_nograd_batch(threads: int | None = None) -> int:
    """The measured CPU default at `threads` torch threads (default: this process's `torch.get_num_threads()`)."""
    t = torch.get_num_threads() if threads is None else threads
    return CPU_NOGRAD_BATCH[min(max(t, 1), max(CPU_NOGRAD_BATCH))]


def set_nograd_batch(batch: int | None) -> None:
    """This process's `engine.nograd_batch` (None: the per-device default); set by `Runtime.build`."""
    global _nograd_override
    if batch is not None and batch <= 0:
        raise ValueError(f"the no-grad batch must be positive, got {batch}")
    _nograd_override = batch


def nograd_batch(device: torch.device | str, requested: int) -> int:
    """The batch of a no-grad pass on `device` whose own size is `requested`: the configured `engine.nograd_batch`,
    else the measured CPU default for this process's torch threads on the CPU, else `requested`."""
    if _nograd_override is not None:
        return _nograd_override
    if torch.device(device).type == "cpu":
        return cpu_nograd_batch()
    return requested


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
