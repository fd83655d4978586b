"""DualPrompt's complementary prompts (Wang et al., ECCV 2022, §4, Eq. 2–6).

G(eneral)-prompt: one shared prefix of length L_g = 5 in layers 0–1. E(xpert)-prompt: a pool of E = 10
task prompts of length L_e = 5 with keys, in layers 2–4. Both are prefix-tuning prompts with separate key and
value halves: a prompt of length L is a (2L, d) tensor, its first L tokens prepended to the keys and the last L
to the values (the official code's `(2, L, d)` prefix). Training task t uses E-prompt t directly (task identity
is known) with the matching loss λ·(1 − cos(q, K_t)), λ = 1 (`pull_constraint_coeff` of the official configs);
evaluation picks the E-prompt of the key nearest to the query (top-1 cosine). Init U(−1, 1) (official code).
"""

from __future__ import annotations

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import PromptPool, cosine, uniform_


class DualPromptPool(PromptPool):
    """G-prompt prefixes plus a task-keyed E-prompt pool."""

    def __init__(
        self,
        dim: int,
        g_layers: tuple[int, ...] | list[int] = (0, 1),
        g_length: int = 5,
        e_layers: tuple[int, ...] | list[int] = (2, 3, 4),
        e_length: int = 5,
        pool_size: int = 10,
        pull_coef: float = 1.0,
    ) -> None:
        super().__init__()
        if set(g_layers) & set(e_layers):
            raise ValueError("G- and E-prompt layers must differ")
        self.g_layers, self.e_layers, self.pull_coef = tuple(g_layers), tuple(e_layers), pull_coef
        self.g_prompts = nn.Parameter(uniform_(torch.empty(len(self.g_layers), 2 * g_length, dim), -1, 1))
        self.e_prompts = nn.Parameter(uniform_(torch.empty(len(self.e_layers), pool_size, 2 * e_length, dim), -1, 1))
        self.keys = nn.Parameter(uniform_(torch.empty(pool_size, dim), -1, 1))

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        if query is None:
            raise ValueError("DualPromptPool needs the query q(x)")
        q = query.detach()
        sim = cosine(q, self.keys)
        if self.training:
            if self.task >= self.keys.shape[0]:
                raise ValueError(f"task {self.task} has no E-prompt: the pool holds {self.keys.shape[0]}")
            ids = torch.full((len(q),), self.task, dtype=torch.long, device=q.device)
        else:
            ids = sim[:, : self.task + 1].argmax(1)  # only E-prompts of tasks seen so far exist
        self.selected = ids
        self.aux_loss = (
            self.pull_coef * (1 - sim.gather(1, ids[:, None])).mean() if self.training else sim.new_zeros(())
        )
        prompts = {layer: self.g_prompts[i].unsqueeze(0) for i, layer in enumerate(self.g_layers)}
        prompts.update({layer: self.e_prompts[i, ids] for i, layer in enumerate(self.e_layers)})
        return PromptSpec.split_half(prompts)
