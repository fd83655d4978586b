"""L2P's prompt pool with key–query matching (Wang et al., CVPR 2022, §4.2–4.3, Eq. 3–5).

A pool of M prompts (default 10, length 5) with learnable keys; for query q the top-k (default 5) keys by
cosine select prompts that are concatenated and inserted as input tokens after CLS with no positional
embedding (`mode="tokens"`, L2P's default), or as split-half prefixes in chosen layers (`mode="prefix"`).
Surrogate (pull-constraint) loss: λ·mean over batch and selected keys of (1 − cos(q, K_s)), λ = 0.1 (L2P
`pull_constraint_coeff`); the query is detached, so it only moves keys. Options: batch-wise voting (L2P
`batchwise_prompt`: the k ids selected most often in the batch serve every sample) and a train-time task
partition (`task_partition` prompts per task; training task t can select only its own block, evaluation every
block seen so far). Init U(−1, 1) for prompts and keys (L2P `prompt_init='uniform'`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import PromptPool, cosine, uniform_


def top_k_ids(sim: torch.Tensor, k: int, batchwise: bool) -> torch.Tensor:
    """(B, k) ids of the k highest similarities; with `batchwise`, the batch's k most frequent ids for all."""
    ids = sim.topk(k, dim=1).indices
    if not batchwise:
        return ids
    counts = torch.bincount(ids.flatten(), minlength=sim.shape[1])
    major = torch.sort(counts, descending=True, stable=True).indices[:k]  # ties → lower id first
    return major.unsqueeze(0).expand(sim.shape[0], -1)


class L2PPool(PromptPool):
    """L2P: top-k key matching over a prompt pool; pull-constraint loss on the selected keys."""

    def __init__(
        self,
        dim: int,
        pool_size: int = 10,
        length: int = 5,
        top_k: int = 5,
        mode: Literal["tokens", "prefix"] = "tokens",
        layers: tuple[int, ...] | list[int] = (0,),
        pull_coef: float = 0.1,
        batchwise_voting: bool = False,
        task_partition: int | None = None,
    ) -> None:
        super().__init__()
        if mode == "prefix" and length % 2:
            raise ValueError("prefix-mode L2P prompts need an even length (half keys, half values)")
        if top_k > pool_size:
            raise ValueError(f"top_k {top_k} exceeds the pool size {pool_size}")
        self.mode, self.layers, self.top_k = mode, tuple(layers), top_k
        self.pull_coef, self.batchwise, self.task_partition = pull_coef, batchwise_voting, task_partition
        n_layers = len(self.layers) if mode == "prefix" else 1
        self.keys = nn.Parameter(uniform_(torch.empty(pool_size, dim), -1, 1))
        self.prompts = nn.Parameter(uniform_(torch.empty(n_layers, pool_size, length, dim), -1, 1))

    def selectable(self) -> torch.Tensor:
        """Bool mask of the prompts this forward may choose from."""
        mask = torch.ones(self.keys.shape[0], dtype=torch.bool, device=self.keys.device)
        if self.task_partition is not None:
            p = self.task_partition
            mask[:] = False
            if self.training:
                mask[self.task * p : (self.task + 1) * p] = True
            else:
                mask[: (self.task + 1) * p] = True
        return mask

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        if query is None:
            raise ValueError("L2PPool needs the query q(x)")
        q = query.detach()
        sim = cosine(q, self.keys).masked_fill(~self.selectable(), float("-inf"))
        ids = top_k_ids(sim, min(self.top_k, int(self.selectable().sum())), self.batchwise)
        self.selected = ids
        self.aux_loss = self.pull_coef * (1 - cosine(q, self.keys).gather(1, ids)).mean()
        chosen = self.prompts[:, ids]  # (layers, B, k, L, d)
        if self.mode == "tokens":
            return PromptSpec(tokens=chosen[0].flatten(1, 2), token_position="prepend")
        half = chosen.shape[3] // 2  # each selected prompt keeps its own key half and value half
        return PromptSpec(
            prefix={
                layer: (chosen[i, :, :, :half].flatten(1, 2), chosen[i, :, :, half:].flatten(1, 2))
                for i, layer in enumerate(self.layers)
            }
        )
