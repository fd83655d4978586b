"""Gram matrices XᵀX of the inputs of linear layers on a client's data — what RegMean-style merging uploads.

One no-grad pass over the client's data (the eval transform, or LoRM's `gram_images: train` augmentation); forward
hooks on the given `nn.Linear` modules record their inputs, every token of every image (a ViT projection sees B·N
rows per batch), accumulated in float64. The features returned by `features(x)` (the head's input) get their Gram
too. `diagonal=True` keeps only Σ x² per input dimension, all a diagonal (γ = 0) RegMean merge needs and far cheaper
for wide layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import ImageTransform


def _accumulate(store: dict[str, torch.Tensor], name: str, x: torch.Tensor, diagonal: bool) -> None:
    x = x.detach().reshape(-1, x.shape[-1]).double()
    g = x.pow(2).sum(0) if diagonal else x.T @ x
    store[name] = g if name not in store else store[name] + g


@torch.no_grad()
def input_grams(
    features: Callable[[torch.Tensor], torch.Tensor],
    modules: Mapping[str, nn.Module],
    data: LabeledSubset,
    transform: ImageTransform,
    device: torch.device,
    diagonal: bool = False,
    batch_size: int = 128,
    generator: torch.Generator | None = None,
    passes: int = 1,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """({name: Gram of that module's inputs}, Gram of the features) over `data`, float64 on the CPU.

    Module Grams are (n, n), or their (n,) diagonal with `diagonal=True`; the feature Gram is always full (d, d).
    `passes` passes over the data add up (fed-mammoth's `regmean_rounds`); an augmenting `transform` draws from
    `generator` (without one the transform does not augment). The batch is `nograd_batch(device, batch_size)` (it
    changes the Grams only at float rounding). Empty data gives ({}, None).
    """
    grams: dict[str, torch.Tensor] = {}
    feats: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_hook(lambda _m, inputs, _out, name=name: _accumulate(grams, name, inputs[0], diagonal))
        for name, m in modules.items()
    ]
    batch = nograd_batch(device, batch_size)
    try:
        for _ in range(passes):
            for x, _ in data.batches(batch, transform, generator, device=device):
                _accumulate(feats, "features", features(x), False)
    finally:
        for h in handles:
            h.remove()
    return {k: v.cpu() for k, v in grams.items()}, (feats["features"].cpu() if feats else None)
