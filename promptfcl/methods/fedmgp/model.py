"""FedMGP's model and its server-side prompt fusion (see `promptfcl.methods.fedmgp` for the paper mapping).

`MGPModel` is one client's model on the shared frozen backbone: the coarse global prompt pool (L2P, input
tokens before the patches) with the global head H_g, the fine class-wise local prefix prompts, and one local
head per task. `distill_pool` is the selective prompt fusion of Eq. 11.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.backbones.precision import LossScaler
from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.backbones.query_cache import QueryCache, state_version
from promptfcl.backbones.vit import FrozenViT
from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import ImageTransform
from promptfcl.methods.fedmgp.class_prefix import ClassPrefixPool
from promptfcl.prompts.l2p import L2PPool

HeadKind = Literal["mlp", "linear"]
Readout = Literal["prompt_mean", "cls"]
GLOBAL_POOL = "global_pool."
GLOBAL_HEAD = "global_head."
LOCAL_POOL = "local_pool."


def make_head(dim: int, num_logits: int, kind: HeadKind, hidden: int) -> nn.Module:
    """The official code's MLP head (d → hidden → ReLU → C) or a linear head."""
    if kind == "linear":
        return nn.Linear(dim, num_logits)
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, num_logits))


def key_hits(selected: torch.Tensor, labels: torch.Tensor) -> int:
    """How many samples have their own class's prompt among their selected prompt ids (B, k)."""
    return int((selected == labels.to(selected.device).unsqueeze(1)).any(dim=1).sum())


def key_chance(top_k: int, candidates: int) -> float:
    """% of samples a uniformly random choice of `top_k` of `candidates` prompts would hit: 100·min(k, C)/C."""
    return 100.0 * min(top_k, candidates) / candidates


def subset_state(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """Detached copies of the state entries under `prefix` (prefix kept)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if k.startswith(prefix)}


class MGPModel(nn.Module):
    """One FedMGP client model. `forward(x)` is the global model (global prompts + H_g).

    The backbone is held by reference (not a submodule), so `state_dict()` holds only what FedMGP learns.
    """

    def __init__(
        self,
        backbone: FrozenViT,
        num_logits: int,
        num_tasks: int,
        global_pool: L2PPool | None,
        local_pool: ClassPrefixPool | None,
        head: HeadKind = "mlp",
        head_hidden: int = 512,
        readout: Readout = "prompt_mean",
    ) -> None:
        super().__init__()
        object.__setattr__(self, "backbone", backbone)
        d = backbone.embed_dim
        self.global_pool = global_pool
        self.global_head = make_head(d, num_logits, head, head_hidden)
        self.local_pool = local_pool
        self.local_heads = nn.ModuleList(
            [make_head(d, num_logits, head, head_hidden) for _ in range(num_tasks)] if local_pool is not None else []
        )
        self.readout = readout
        self.local_aux: torch.Tensor = torch.zeros(())
        self.vx_cache: QueryCache | None = None  # set by the client program (FedMGP's `query_cache`)

    @property
    def prompted(self) -> bool:
        return self.global_pool is not None or self.local_pool is not None

    @property
    def prompt_free_forward(self) -> bool:
        """False when the heads read the global prompt tokens' outputs (`prompt_mean`): without prompts there is
        nothing to read, so the validity gate's with / without prompts comparison is undefined for this model."""
        return not (self.readout == "prompt_mean" and self.global_pool is not None)

    # ------------------------------------------------------------------------------------- pieces
    def global_spec(self, x: torch.Tensor) -> PromptSpec | None:
        """The selected global prompts for `x` (query: the unprompted frozen feature), or None without a pool."""
        if self.global_pool is None:
            return None
        return self.global_pool(x.shape[0], self.backbone.query(x))

    def read(self, tokens: torch.Tensor, spec: PromptSpec | None) -> torch.Tensor:
        """The head's input: the mean of the prompt-token outputs (official `head_type='prompt'`) or CLS."""
        if self.readout == "prompt_mean" and spec is not None and spec.tokens is not None:
            start = self.backbone.num_prefix_tokens
            return tokens[:, start : start + spec.tokens.shape[1]].mean(dim=1)
        return self.backbone.vit.forward_head(tokens, pre_logits=True)

    def global_features(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.global_spec(x)
        return self.read(self.backbone.tokens(x, spec), spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The coarse global model: global prompts + global head H_g (phase 1, Eq. 6)."""
        return self.global_head(self.global_features(x))

    @torch.no_grad()
    def frozen_global_spec(self, x: torch.Tensor) -> PromptSpec | None:
        """The global prompts as phase 2 sees them: frozen, eval-mode selection (every seen prompt, no pull)."""
        if self.global_pool is None:
            return None
        was = self.global_pool.training
        self.global_pool.eval()
        spec = self.global_spec(x)
        self.global_pool.train(was)
        return spec

    @torch.no_grad()
    def local_query(self, x: torch.Tensor, gspec: PromptSpec | None = None) -> torch.Tensor:
        """V(x'): the global-prompted feature that selects local prompts at test time (and that phase 2's pull
        constraint uses). With `vx_cache` set it is kept per exact input and global-prompt state (`vx_version`):
        the global prompts are frozen in phase 2, so every later epoch reuses it."""
        if self.vx_cache is not None:
            return self.vx_cache(x, self._global_prompted_query, self.vx_version())
        gspec = self.frozen_global_spec(x) if gspec is None else gspec
        return self.read(self.backbone.tokens(x, gspec), gspec)

    def _global_prompted_query(self, x: torch.Tensor) -> torch.Tensor:
        gspec = self.frozen_global_spec(x)
        return self.read(self.backbone.tokens(x, gspec), gspec)

    def vx_version(self) -> bytes:
        """What V(x') depends on besides the image: the global pool's tensors and task, the readout, and whether
        the backbone's prompts are switched off."""
        pool, off = self.global_pool, getattr(self.backbone, "_prompts_off", False)
        if pool is None:
            return repr((self.readout, off)).encode()
        return state_version(pool, pool.task, self.readout, off)

    def local_logits(
        self,
        x: torch.Tensor,
        task: int,
        labels: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
        top_k: int = 1,
        batchwise: bool = False,
        pull: bool = False,
    ) -> torch.Tensor:
        """The fine local model (phase 2, Eq. 10): frozen global prompts, then the class-wise local prompts
        chosen by `labels` (training) or by cosine between the global-prompted query and the local keys."""
        assert self.local_pool is not None
        gspec = self.frozen_global_spec(x)
        query = self.local_query(x, gspec) if labels is None or pull else None
        ids = labels.unsqueeze(1) if labels is not None else self.local_pool.select(query, allowed, top_k, batchwise)
        self.local_aux = self.local_pool.pull_loss(query, ids) if pull and query is not None else x.new_zeros(())
        lspec = self.local_pool(ids)
        spec = lspec if gspec is None else gspec.merge(lspec)
        return self.local_heads[task](self.read(self.backbone.tokens(x, spec), gspec))


def distill_pool(
    student: L2PPool,
    teachers: Sequence[L2PPool],
    backbone: FrozenViT,
    proxy: LabeledSubset,
    transform: ImageTransform,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    generator: torch.Generator,
    device: torch.device,
) -> list[float]:
    """Selective prompt fusion by distillation (Eq. 11): train the student pool so the backbone's output token
    sequence under its prompts matches each teacher's, Σ_teachers MSE(V(x'_student), V(x'_teacher)), on the
    server's proxy images. Every pool selects its prompts with its own keys (eval-mode selection). Returns the
    mean loss of every epoch."""
    student.eval().requires_grad_(True)
    for t in teachers:
        t.eval().requires_grad_(False)
    params = list(student.parameters())
    opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    scaler = LossScaler(backbone.precision, device)  # fp16: loss scaling through the backbone
    losses = []
    for _ in range(epochs):
        total, n = 0.0, 0
        for x, _y in proxy.batches(batch_size, transform, generator, shuffle=True, device=device):
            q = backbone.query(x)
            with torch.no_grad():
                targets = [backbone.tokens(x, t(x.shape[0], q)) for t in teachers]
            out = backbone.tokens(x, student(x.shape[0], q))
            loss = sum(F.mse_loss(out, tgt) for tgt in targets)
            opt.zero_grad(set_to_none=True)
            scaler.backward(loss)
            scaler.step(opt, params, None)
            total += float(loss.detach()) * len(x)
            n += len(x)
        losses.append(total / max(n, 1))
    return losses


@torch.no_grad()
def distillation_loss(
    student: L2PPool, teachers: Sequence[L2PPool], backbone: FrozenViT, proxy: LabeledSubset,
    transform: ImageTransform, batch_size: int, device: torch.device,
) -> float:  # fmt: skip
    """The Eq. 11 loss of `student` on the whole proxy set (mean over images), without training."""
    student.eval()
    total, n = 0.0, 0
    for x, _y in proxy.batches(nograd_batch(device, batch_size), transform, device=device):
        q = backbone.query(x)
        out = backbone.tokens(x, student(x.shape[0], q))
        total += float(sum(F.mse_loss(out, backbone.tokens(x, t.eval()(x.shape[0], q))) for t in teachers)) * len(x)
        n += len(x)
    return total / max(n, 1)
