"""Incremental LoRA (PILoRA): one LoRA per task on the query and value projections, summed across tasks.

Task i owns A_q^i, A_v^i (r, d) and B_q^i, B_v^i (d, r) in each adapted block's qkv projection (the key part is
not adapted). The delta of the qkv projection after task t stacks into one low-rank `LoRADelta`:
- "products": ΔW_q = Σ_{i≤t} B_q^i·A_q^i (and the same for v) — the sum of the tasks' LoRA modules;
- "factors": ΔW_q = (Σ_{i≤t} B_q^i)·(Σ_{i≤t} A_q^i) — the sum taken factor by factor, as both official codes do.
Only task t's factors are trainable after `set_task(t)`; with `train_with_old=False` the training forward uses
task t's module alone (the official PILoRA code) and evaluation the sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from promptfcl.adapters.lora import kaiming_uniform, lora_sites, lora_spec, site_shape
from promptfcl.backbones.prompt_spec import LoRADelta, PromptSpec
from promptfcl.backbones.vit import FrozenViT

SumMode = Literal["products", "factors"]
FACTORS = ("aq", "av", "bq", "bv")


def orthogonality_loss(current: torch.Tensor, previous: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ_i Σ |A_i·A_tᵀ| over the previous tasks' A_i (r_i, d) and the current A_t (r, d): zero exactly when every
    row of A_t is orthogonal to every row of every A_i (orthogonal input subspaces), positive otherwise."""
    if not previous:
        return current.new_zeros(())
    return sum(((p.detach() @ current.T).abs().sum() for p in previous), current.new_zeros(()))


class IncrementalQVLoRA(nn.Module):
    """Per-task q/v LoRA factors on the qkv projection of `layers`, summed over the tasks seen so far."""

    needs_query = False

    def __init__(
        self,
        backbone: FrozenViT,
        num_tasks: int,
        layers: Sequence[int],
        rank: int,
        sum_mode: SumMode = "products",
        train_with_old: bool = True,
    ) -> None:
        super().__init__()
        self.layers = [layer for layer, _ in lora_sites(backbone, layers, ["qkv"])]
        self.num_tasks, self.rank, self.sum_mode, self.train_with_old = num_tasks, rank, sum_mode, train_with_old
        self.dim = backbone.embed_dim
        if any(site_shape(backbone, (layer, "qkv")) != (3 * self.dim, self.dim) for layer in self.layers):
            raise ValueError("incremental q/v LoRA needs a fused qkv projection of shape (3·d, d)")
        self.factors = nn.ParameterDict()
        for t in range(num_tasks):
            for layer in self.layers:
                for f in FACTORS:
                    init = kaiming_uniform(rank, self.dim) if f[0] == "a" else torch.zeros(self.dim, rank)
                    self.factors[self.key(f, t, layer)] = nn.Parameter(init)
        self.task = 0
        self.set_task(0)

    @staticmethod
    def key(factor: str, task: int, layer: int) -> str:
        return f"{factor}_{task}_{layer}"

    def task_keys(self, task: int) -> list[str]:
        """The state-dict names (under `factors.`) of one task's factors."""
        return [self.key(f, task, layer) for layer in self.layers for f in FACTORS]

    def set_task(self, task: int) -> None:
        """Serve task `task`: its factors train, earlier ones are frozen and summed in, later ones unused."""
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"task {task} outside 0..{self.num_tasks - 1}")
        self.task = task
        for t in range(self.num_tasks):
            for k in self.task_keys(t):
                self.factors[k].requires_grad_(t == task)

    def factor(self, name: str, task: int, layer: int) -> torch.Tensor:
        return self.factors[self.key(name, task, layer)]

    def tasks_in_forward(self) -> list[int]:
        if self.training and not self.train_with_old:
            return [self.task]
        return list(range(self.task + 1))

    def delta(self, layer: int, tasks: Sequence[int]) -> LoRADelta:
        """The qkv delta of `layer` for `tasks`, as one low-rank factor pair (B has zero rows for k)."""
        d, z = self.dim, None
        pairs = []  # (A (r, d), B block (3d, r)) for q and v of every task
        if self.sum_mode == "factors":
            groups = [[(self.factor(f"a{p}", t, layer), self.factor(f"b{p}", t, layer)) for t in tasks] for p in "qv"]
            summed = [(sum(a for a, _ in g), sum(b for _, b in g)) for g in groups]
            pairs = [(summed[0][0], summed[0][1], 0), (summed[1][0], summed[1][1], 2)]
        else:
            for t in tasks:
                pairs.append((self.factor("aq", t, layer), self.factor("bq", t, layer), 0))
                pairs.append((self.factor("av", t, layer), self.factor("bv", t, layer), 2))
        a = torch.cat([p[0] for p in pairs], dim=0)
        cols = []
        for _, b, part in pairs:
            z = b.new_zeros(d, b.shape[1])
            cols.append(torch.cat([b if part == 0 else z, z, b if part == 2 else z], dim=0))
        return LoRADelta(a, torch.cat(cols, dim=1))

    def orthogonality(self) -> torch.Tensor:
        """PILoRA's l_ort for the current task: Σ over layers, q and v, and previous tasks of Σ |A_i·A_tᵀ|."""
        t = self.task
        total = torch.zeros(())  # no layers (`layers: []`, the prototypes alone): nothing to keep orthogonal
        for layer in self.layers:
            for f in ("aq", "av"):
                previous = [self.factor(f, i, layer) for i in range(t)]
                total = total + orthogonality_loss(self.factor(f, t, layer), previous)
        return total

    def l1(self) -> torch.Tensor:
        """Σ |A_q^t| + |A_v^t| over layers (the official code's sparsity term on the current task's A)."""
        t = self.task
        terms = (self.factor(f, t, layer).abs().sum() for layer in self.layers for f in ("aq", "av"))
        return sum(terms, torch.zeros(()))

    def forward(self, batch_size: int = 1, query: torch.Tensor | None = None) -> PromptSpec:
        tasks = self.tasks_in_forward()
        return lora_spec({(layer, "qkv"): self.delta(layer, tasks) for layer in self.layers})
