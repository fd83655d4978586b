"""DualPrompt's complementary prompts (Wang et al., "DualPrompt: Complementary Prompting for Rehearsal-free
Continual Learning", ECCV 2022, §4.1 G-/E-prompts, §4.2 prefix-tuning, §4.3 Eq. 2–4 matching and objective).

G(eneral)-prompt: one shared prefix prompt in `g_layers` (default 0–1). E(xpert)-prompt: a pool of `pool_size`
(default 10) task prompts in `e_layers` (default 2–4) with one key per prompt (E, d), shared by the E-layers.
Both are prefix-tuning prompts with explicit key and value parts of `length` tokens each, stored as one
(2·length, d) tensor whose first half is prepended to the attention keys and second half to the values (the
official `(2, length, d)` prefix; `PromptSpec.split_half`). Defaults follow the official configs (JAX code and
its PyTorch port): g_length = e_length = 5 (5 key + 5 value tokens), pull coefficient λ = 1.
Training on task t uses E-prompt t (task identity is known at training time; official `prompt_mask`) and the
matching loss λ · mean_b (1 − cos(q_b, K_t)) (Eq. 4; the query is detached, so it moves K_t only). Evaluation
picks, per sample, the E-prompt whose key is nearest to the query (top-1 cosine). Init U(−1, 1) for prompts and
keys (official `initializer` / `prompt_key_init = 'uniform'`).

Deviations / notes:
- Evaluation only considers the keys of tasks ≤ t (the official code ranks every key, trained or not).
- The official configs set `batchwise_prompt = True`, which also applies at test time and lets a single-task test
  batch vote on its E-prompt; `batchwise_voting` reproduces it, off by default.
- CODA-P's re-implementation (whose codebase HePCo reuses) runs `--prompt_param 10 20 6`: split-half lengths 20
  (E) and 6 (G), i.e. `e_length=10, g_length=3` here; the released DualPrompt configs use 5 and 5.
"""

from __future__ import annotations

import torch
from torch import nn

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.prompts.pools import PromptPool, cosine, require_query, top_k_ids, uniform_


class DualPromptPool(PromptPool):
    """G-prompt prefixes plus a task-keyed E-prompt pool (task id at training, nearest key at evaluation)."""

    def __init__(
        self,
        dim: int,
        g_layers: tuple[int, ...] | list[int] = (0, 1),
        g_length: int = 5,
        e_layers: tuple[int, ...] | list[int] = (2, 3, 4),
        e_length: int = 5,
        pool_size: int = 10,
        pull_coef: float = 1.0,
        batchwise_voting: bool = False,
    ) -> None:
        super().__init__()
        if set(g_layers) & set(e_layers):
            raise ValueError("G- and E-prompt layers must differ")
        self.g_layers, self.e_layers = tuple(g_layers), tuple(e_layers)
        self.pull_coef, self.batchwise = pull_coef, batchwise_voting
        self.g_prompts = nn.Parameter(uniform_(torch.empty(len(self.g_layers), 2 * g_length, dim), -1, 1))
        self.e_prompts = nn.Parameter(uniform_(torch.empty(len(self.e_layers), pool_size, 2 * e_length, dim), -1, 1))
        self.keys = nn.Parameter(uniform_(torch.empty(pool_size, dim), -1, 1))

    def set_task(self, task: int) -> None:
        if task >= self.keys.shape[0]:
            raise ValueError(f"task {task} has no E-prompt: the pool holds {self.keys.shape[0]}")
        super().set_task(task)

    def forward(self, batch_size: int, query: torch.Tensor | None = None) -> PromptSpec:
        q = require_query(self, query).detach()
        sim = cosine(q, self.keys)
        if self.training:
            ids = torch.full((len(q),), self.task, dtype=torch.long, device=q.device)
            self.aux_loss = self.pull_coef * (1 - sim[:, self.task]).mean()
        else:
            seen = sim.clone()
            seen[:, self.task + 1 :] = float("-inf")  # only E-prompts of tasks seen so far exist
            ids = top_k_ids(seen, 1, self.batchwise)[:, 0]
            self._no_aux(q)
        self.selected = ids
        prompts = {layer: self.g_prompts[i].unsqueeze(0) for i, layer in enumerate(self.g_layers)}
        prompts.update({layer: self.e_prompts[i, ids] for i, layer in enumerate(self.e_layers)})
        return PromptSpec.split_half(prompts)
