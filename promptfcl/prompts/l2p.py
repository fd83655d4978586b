"""L2P's prompt pool with key–query matching (Wang et al., "Learning to Prompt for Continual Learning", CVPR 2022,
§4.2 prompt pool, §4.3 instance-wise query and Eq. 3–5).

A pool of M prompts (default 10, length L_p = 5) with learnable keys (M, d). For the query q(x) the top-k (default
5) keys by cosine select k prompts, concatenated along the token axis (B, k·L_p, d) and inserted as input tokens
right after CLS with no positional embedding (`mode="tokens"`, L2P's prompt tuning), or, with `mode="prefix"`,
as prefixes in `layers`: every selected prompt gives its first L_p/2 tokens to the keys and its last L_p/2 to the
values (L_p must be even). One key set serves all layers (as in L2P's / DualPrompt's code).

Surrogate loss (Eq. 5, the "pull constraint"): λ · mean over batch and selected keys of (1 − cos(q, K_s)), with
λ = 0.1 (`pull_constraint_coeff`). The query is detached, so the loss moves only the selected keys.
Options: `batchwise_voting` (official `batchwise_prompt`: the k ids chosen most often in the batch serve every
sample) and `task_partition` = p (official train-time prompt mask: training on task t may select only prompts
[t·p, (t+1)·p); evaluation may select every prompt of tasks ≤ t). Init: prompts and keys U(−1, 1) (official
`prompt_init` / `prompt_key_init = 'uniform'`).

Deviations / notes:
- L2P's code reduces the pull loss as Σ_k cos / B (a sum over the k selected keys); the mean used here is k times
  weaker, so `pull_coef = 0.1·k` reproduces the official strength.
- The official configs turn batch-wise voting on; at test time a single-task batch then leaks task identity. Here
  it is off by default.
- The official prompt mask forces prompts [t·p, (t+1)·p) (equal to "select within the block" when p = k); at
  evaluation it masks nothing, here prompts of unseen tasks stay unselectable.
- L2P classifies the mean of the prompt-token outputs; `PromptedClassifier` reads CLS (a model-level choice,
  outside this module).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import PromptPool, cosine, require_query, top_k_ids, uniform_


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
        if mode not in ("tokens", "prefix"):
            raise ValueError(f"unknown L2P mode {mode!r}")
        if mode == "prefix" and length % 2:
            raise ValueError("prefix-mode L2P prompts need an even length (half keys, half values)")
        if top_k > pool_size:
            raise ValueError(f"top_k {top_k} exceeds the pool size {pool_size}")
        if task_partition is not None and not 0 < task_partition <= pool_size:
            raise ValueError(f"task_partition must be in 1..{pool_size}, got {task_partition}")
        self.mode, self.layers, self.top_k = mode, tuple(layers), top_k
        self.pull_coef, self.batchwise, self.task_partition = pull_coef, batchwise_voting, task_partition
        n_layers = len(self.layers) if mode == "prefix" else 1
        self.keys = nn.Parameter(uniform_(torch.empty(pool_size, dim), -1, 1))
        self.prompts = nn.Parameter(uniform_(torch.empty(n_layers, pool_size, length, dim), -1, 1))

    def set_task(self, task: int) -> None:
        p = self.task_partition
        if p is not None and (task + 1) * p > self.keys.shape[0]:
            raise ValueError(f"task {task} needs prompts up to {(task + 1) * p}, the pool holds {self.keys.shape[0]}")
        super().set_task(task)

    def selectable(self) -> torch.Tensor:
        """Bool mask (M,) of the prompts this forward may choose from."""
        mask = torch.ones(self.keys.shape[0], dtype=torch.bool, device=self.keys.device)
        p = self.task_partition
        if p is not None:
            start = self.task * p if self.training else 0  # training: own block only; eval: all seen blocks
            mask[:] = False
            mask[start : (self.task + 1) * p] = True
        return mask

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        q = require_query(self, query).detach()
        allowed = self.selectable()
        sim = cosine(q, self.keys)
        ids = top_k_ids(sim.masked_fill(~allowed, float("-inf")), min(self.top_k, int(allowed.sum())), self.batchwise)
        self.selected = ids
        if self.training:
            self.aux_loss = self.pull_coef * (1 - sim.gather(1, ids)).mean()
        else:
            self._no_aux(q)
        chosen = self.prompts[:, ids]  # (layers, B, k, L, d)
        if self.mode == "tokens":
            return PromptSpec(tokens=chosen[0].flatten(1, 2), token_position="prepend")
        half = chosen.shape[3] // 2  # every selected prompt keeps its own key half and value half
        return PromptSpec(
            prefix={
                layer: (chosen[i, :, :, :half].flatten(1, 2), chosen[i, :, :, half:].flatten(1, 2))
                for i, layer in enumerate(self.layers)
            }
        )
