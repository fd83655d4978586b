"""LoRA modules: learnable low-rank deltas on the frozen ViT's projections, producing a `PromptSpec`.

A module here plays the role a prompt module plays in `PromptedClassifier` (it is its `prompt`): called with the
batch size it returns a `PromptSpec` whose `lora` field carries ΔW = scale·B·A for each (layer, projection)
site; the frozen backbone applies it unmerged beside W (`backbones.vit`). Prompts and deltas compose through
`PromptSpec.merge`. Initialisation follows LoRA (Hu et al., ICLR 2022, §4.1): A ~ Kaiming-uniform (the bound
1/√in that `nn.init.kaiming_uniform_(a=√5)` gives), B = 0, so a fresh adapter leaves the frozen output unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import LORA_TARGETS, LoRADelta, PromptSpec
from promptfcl.backbones.vit import FrozenViT

Site = tuple[int, str]  # (block index, projection: qkv | proj | fc1 | fc2)


def site_key(site: Site) -> str:
    """The name of a site in state dicts and messages: `<layer>_<target>`."""
    return f"{site[0]}_{site[1]}"


def parse_site(key: str) -> Site:
    layer, target = key.split("_", 1)
    return int(layer), target


def lora_sites(backbone: FrozenViT, layers: Sequence[int] | None, targets: Sequence[str]) -> list[Site]:
    """Every (layer, target) pair, validated against the backbone (None: all layers)."""
    n = backbone.num_layers
    layers = list(range(n)) if layers is None else list(layers)
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise ValueError(f"LoRA layers {bad} outside the backbone's 0..{n - 1}")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(f"LoRA targets {list(targets)} must be a non-empty subset of {list(LORA_TARGETS)}")
    return [(i, t) for i in sorted(set(layers)) for t in LORA_TARGETS if t in targets]


def site_weight(backbone: FrozenViT, site: Site) -> nn.Linear:
    """The frozen timm Linear a site adapts."""
    layer, target = site
    blk = backbone.vit.blocks[layer]
    return (blk.attn if target in ("qkv", "proj") else blk.mlp).get_submodule(target)


def site_shape(backbone: FrozenViT, site: Site) -> tuple[int, int]:
    """(out, in) of the adapted weight."""
    w = site_weight(backbone, site).weight
    return int(w.shape[0]), int(w.shape[1])


def kaiming_uniform(rows: int, fan_in: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """U(−1/√fan_in, 1/√fan_in): what `nn.init.kaiming_uniform_(w, a=√5)` draws, from a given generator."""
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rows, fan_in, generator=generator) * 2 - 1) * bound


def lora_spec(deltas: Mapping[Site, LoRADelta]) -> PromptSpec:
    """A `PromptSpec` carrying the given deltas."""
    lora: dict[int, dict[str, LoRADelta]] = {}
    for (layer, target), d in deltas.items():
        lora.setdefault(layer, {})[target] = d
    return PromptSpec(lora=lora)


class LoRAAdapter(nn.Module):
    """Trainable A (r, in) and B (out, r) per site; `forward` → `PromptSpec(lora=...)` with ΔW = scale·B·A.

    `trainable` selects which factor gets gradients ("both", "A", "B"; LoRM trains one at a time).
    """

    needs_query = False

    def __init__(
        self,
        backbone: FrozenViT,
        layers: Sequence[int] | None,
        targets: Sequence[str],
        rank: int,
        scale: float = 1.0,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.sites = lora_sites(backbone, layers, targets)
        self.rank, self.scale = rank, scale
        self.a = nn.ParameterDict()
        self.b = nn.ParameterDict()
        for site in self.sites:
            out, inp = site_shape(backbone, site)
            self.a[site_key(site)] = nn.Parameter(kaiming_uniform(rank, inp))
            self.b[site_key(site)] = nn.Parameter(torch.zeros(out, rank))

    def reset(self, generator: torch.Generator | None = None) -> None:
        """A fresh adapter: A Kaiming-uniform, B = 0 (ΔW = 0)."""
        with torch.no_grad():
            for key, a in self.a.items():
                a.copy_(kaiming_uniform(a.shape[0], a.shape[1], generator))
                self.b[key].zero_()

    def set_trainable(self, which: str) -> None:
        """Gradients for A, B or both (the frozen factor keeps `requires_grad=False`, so no optimizer sees it)."""
        if which not in ("A", "B", "both"):
            raise ValueError(f"trainable factor must be A, B or both, got {which!r}")
        for p in self.a.values():
            p.requires_grad_(which in ("A", "both"))
        for p in self.b.values():
            p.requires_grad_(which in ("B", "both"))

    def deltas(self) -> dict[Site, LoRADelta]:
        return {s: LoRADelta(self.a[site_key(s)], self.b[site_key(s)], self.scale) for s in self.sites}

    def forward(self, batch_size: int = 1, query: torch.Tensor | None = None) -> PromptSpec:
        return lora_spec(self.deltas())


class FixedDeltas(nn.Module):
    """Non-trainable deltas (e.g. a server-side merge) as a prompt module; its state dict is empty."""

    needs_query = False

    def __init__(self, deltas: Mapping[Site, LoRADelta] | Iterable[tuple[Site, LoRADelta]] = ()) -> None:
        super().__init__()
        items = deltas.items() if isinstance(deltas, Mapping) else deltas
        self.fixed = {s: LoRADelta(d.a.detach() if d.a is not None else None, d.b.detach(), d.scale) for s, d in items}

    def forward(self, batch_size: int = 1, query: torch.Tensor | None = None) -> PromptSpec:
        return lora_spec(self.fixed)
