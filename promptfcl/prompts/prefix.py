"""A single shared prefix prompt per layer (HGP, FedAvg-Prompt)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec


class PrefixPrompt(nn.Module):
    """One learnable (length, d) prompt in each of `layers`, split half/half into key and value prefixes.

    `init="zeros"` reproduces the official HGP code (its CODA-style init with pool size 1 yields zeros);
    `"uniform"` draws U(0, 1) as CODA-P's `tensor_prompt` does with `ortho=False`.
    """

    needs_query = False

    def __init__(
        self,
        dim: int,
        layers: tuple[int, ...] | list[int] = (0, 1, 2, 3, 4),
        length: int = 20,
        init: Literal["zeros", "uniform"] = "zeros",
    ) -> None:
        super().__init__()
        if length % 2:
            raise ValueError("prefix length must be even (half keys, half values)")
        self.layers = tuple(layers)
        self.prompts = nn.Parameter(torch.zeros(len(self.layers), length, dim))
        if init == "uniform":
            nn.init.uniform_(self.prompts)

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        return PromptSpec.split_half({layer: self.prompts[i].unsqueeze(0) for i, layer in enumerate(self.layers)})
