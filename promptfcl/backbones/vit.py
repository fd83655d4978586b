"""A frozen timm Vision Transformer that accepts a `PromptSpec` — the project's one prompt-injection path.

Prefix prompts are concatenated to each block's keys and values *after* the qkv projection (the CODA-P /
DualPrompt / HGP convention) and attention is computed with `F.scaled_dot_product_attention`. Low-rank weight
deltas (`PromptSpec.lora`, LoRA) are added beside the frozen qkv / proj / fc1 / fc2 projections of their
blocks, unmerged (W·x + s·B·(A·x)), in the same forward as the prompts. A block with neither is timm's own
module call, so without prompts and deltas the output equals timm's `forward_features` exactly.
One instance is shared by every simulated client; it is always in eval mode and has no trainable parameter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.backbones.hybrid import has_stem
from promptfcl.backbones.precision import Precision, autocast
from promptfcl.backbones.prompt_spec import LORA_TARGETS, LoRADelta, PromptSpec
from promptfcl.backbones.query_cache import QueryCache
from promptfcl.config import BackboneConfig

if TYPE_CHECKING:
    from promptfcl.data.transforms import ImageTransform


class BackboneError(RuntimeError):
    """The backbone cannot be built or its weights cannot be found; the message says what to provide."""


def _expand(t: torch.Tensor, b: int) -> torch.Tensor:
    return t if t.shape[0] == b else t.expand(b, *t.shape[1:])


def _linear(layer: nn.Module, x: torch.Tensor, delta: LoRADelta | None) -> torch.Tensor:
    """A frozen timm Linear, plus its low-rank delta when one is given (unmerged: W·x + b + s·B·(A·x))."""
    y = layer(x)
    return y if delta is None else y + delta.apply(x)


def attention_qkv(
    attn: nn.Module,
    x: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    qkv_delta: LoRADelta | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head queries, keys and values (B, heads, tokens, head_dim) of a timm `Attention` on `x`, the prefix
    keys/values (B|1, L, d) prepended to K and V (the first L of their tokens)."""
    b, n, _ = x.shape
    h, hd = attn.num_heads, attn.head_dim
    qkv = _linear(attn.qkv, x, qkv_delta)
    q, k, v = qkv.reshape(b, n, 3, h, hd).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    if prefix is not None:
        pk = _expand(prefix[0], b).reshape(b, -1, h, hd).transpose(1, 2).to(k.dtype)
        pv = _expand(prefix[1], b).reshape(b, -1, h, hd).transpose(1, 2).to(v.dtype)
        k = torch.cat([pk, k], dim=2)
        v = torch.cat([pv, v], dim=2)
    return q, k, v


def adapted_attention(
    attn: nn.Module,
    x: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora: dict[str, LoRADelta] | None = None,
) -> torch.Tensor:
    """timm `Attention.forward` with prefix keys/values (B|1, L, d) prepended to K and V and/or low-rank deltas
    on its `qkv` and `proj` projections."""
    lora = lora or {}
    b, n, _ = x.shape
    gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
    q, k, v = attention_qkv(attn, x, prefix, lora.get("qkv"))
    out = F.scaled_dot_product_attention(q, k, v)
    out = out.transpose(1, 2).reshape(b, n, -1)
    out = attn.norm(out)
    if gate is not None:
        out = out * gate
    return attn.proj_drop(_linear(attn.proj, out, lora.get("proj")))


def adapted_mlp(mlp: nn.Module, x: torch.Tensor, lora: dict[str, LoRADelta]) -> torch.Tensor:
    """timm `Mlp.forward` with low-rank deltas on `fc1` / `fc2`."""
    x = mlp.drop1(mlp.act(_linear(mlp.fc1, x, lora.get("fc1"))))
    return mlp.drop2(_linear(mlp.fc2, mlp.norm(x), lora.get("fc2")))


def adapted_block(
    blk: nn.Module,
    x: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    lora: dict[str, LoRADelta] | None = None,
) -> torch.Tensor:
    """timm `Block.forward` with a prefix in its attention and/or low-rank deltas on its projections."""
    lora = lora or {}
    x = x + blk.drop_path1(blk.ls1(adapted_attention(blk.attn, blk.norm1(x), prefix, lora)))
    y = blk.norm2(x)
    y = adapted_mlp(blk.mlp, y, lora) if "fc1" in lora or "fc2" in lora else blk.mlp(y)
    return x + blk.drop_path2(blk.ls2(y))


def check_lora(vit: nn.Module, lora: dict[int, dict[str, LoRADelta]]) -> None:
    """Refuse deltas on missing layers or projections, or whose shapes do not fit the frozen weight."""
    for layer, deltas in lora.items():
        if not 0 <= layer < len(vit.blocks):
            raise ValueError(f"LoRA layer {layer} outside 0..{len(vit.blocks) - 1}")
        blk = vit.blocks[layer]
        for target, d in deltas.items():
            if target not in LORA_TARGETS:
                raise ValueError(f"unknown LoRA target {target!r} in layer {layer}; choose from {LORA_TARGETS}")
            w = (blk.attn if target in ("qkv", "proj") else blk.mlp).get_submodule(target).weight
            shape = tuple(d.b.shape) if d.a is None else (d.b.shape[0], d.a.shape[1])
            inner_ok = d.a is None or d.a.shape[0] == d.b.shape[1]
            if shape != tuple(w.shape) or not inner_ok:
                a_shape = None if d.a is None else tuple(d.a.shape)
                raise ValueError(
                    f"LoRA delta on layer {layer} {target}: A {a_shape}, B {tuple(d.b.shape)} do not give the "
                    f"weight's shape {tuple(w.shape)} (A: (rank, in), B: (out, rank))"
                )


class FrozenViT(nn.Module):
    """Frozen timm ViT with prompt hooks. `forward(x, spec)` → final-norm CLS feature (B, d).

    `stem_cache`: when the patch embedding is a frozen CNN stem (the hybrid backbone), its output depends only on
    the input image, so it is kept per input content (an image and its flip are two entries) and every later
    forward of that image — another epoch, round, client or evaluation — skips the stem.
    `prompts_disabled()`: within it every forward ignores its `PromptSpec` (the validity gate's prompt-free pass).
    `stem_cache_paused()`: within it the stem runs batched and the cache is neither read nor filled (inputs that never
    repeat: randomly cropped training batches).
    `stem_channels_last`: the CNN stem's weights in channels-last memory format (its inputs follow), ≈ 1.3× faster
    on a CPU than the default layout at the same result up to float rounding.
    `configure(precision, compile)`: `engine.precision` / `engine.compile` (set by the runtime).
    """

    def __init__(self, vit: nn.Module, stem_cache_mb: float | None = None, stem_channels_last: bool = True) -> None:
        super().__init__()
        from timm.models.vision_transformer import Block, VisionTransformer

        if not isinstance(vit, VisionTransformer):
            raise BackboneError(f"{type(vit).__name__} is not a timm VisionTransformer")
        if any(type(b) is not Block for b in vit.blocks):
            raise BackboneError("only timm ViTs built from the standard `Block` support prompt injection")
        self.vit = vit.eval()
        for p in self.vit.parameters():
            p.requires_grad_(False)
        self.query_cache: QueryCache | None = None  # set by pool methods that opt in (`enable_query_cache`)
        self.stem_cache: QueryCache | None = None
        if stem_cache_mb and has_stem(vit):
            n, d = vit.patch_embed.num_patches, self.embed_dim
            self.stem_cache = QueryCache(max(1, int(stem_cache_mb * 2**20 // (4 * n * d))), per_sample=True)
        if stem_channels_last and has_stem(vit):  # oneDNN's depthwise and pointwise convs are faster in NHWC
            vit.patch_embed.backbone.to(memory_format=torch.channels_last)
        self._prompts_off = False
        self.configure()

    @property
    def embed_dim(self) -> int:
        return int(self.vit.embed_dim)

    @property
    def num_layers(self) -> int:
        return len(self.vit.blocks)

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.vit.num_prefix_tokens)

    def train(self, mode: bool = True) -> FrozenViT:  # the backbone never leaves eval mode
        return super().train(False)

    def __deepcopy__(self, memo: dict) -> FrozenViT:  # frozen and shared: a copied model keeps this one (and caches)
        return self

    @contextmanager
    def prompts_disabled(self) -> Iterator[None]:
        """Every forward inside ignores its prompt spec: the frozen, prompt-free output (the validity gate)."""
        before, self._prompts_off = self._prompts_off, True
        try:
            yield
        finally:
            self._prompts_off = before

    @contextmanager
    def stem_cache_paused(self) -> Iterator[None]:
        """Every forward inside runs the stem on the whole batch, without reading or filling the cache. For inputs
        that never repeat (a random crop is a new image each time), caching only costs a per-image stem pass (≈ 1.3×
        the batched pass at one thread) and memory that no later forward reads."""
        cache, self.stem_cache = self.stem_cache, None
        try:
            yield
        finally:
            self.stem_cache = cache

    def configure(self, precision: Precision = "fp32", compile: bool = False) -> None:
        """Run every forward under `precision`'s autocast (`backbones.precision`), through `torch.compile` if asked."""
        self.precision = precision
        self._run = torch.compile(FrozenViT._tokens) if compile else FrozenViT._tokens

    def tokens(self, x: torch.Tensor, spec: PromptSpec | None = None) -> torch.Tensor:
        """All output tokens after the final norm, (B, N, d), float32; prompt tokens keep their positions."""
        with autocast(x.device.type, self.precision):
            return self._run(self, x, spec).float()

    def _tokens(self, x: torch.Tensor, spec: PromptSpec | None = None) -> torch.Tensor:
        vit = self.vit
        if self._prompts_off:
            spec = None
        h = vit.norm_pre(self._embed(x, spec))
        prefix = spec.prefix if spec is not None else {}
        lora = {i: d for i, d in spec.lora.items() if d} if spec is not None else {}
        bad = [i for i in prefix if not 0 <= i < len(vit.blocks)]
        if bad:
            raise ValueError(f"prefix layers {bad} outside 0..{len(vit.blocks) - 1}")
        if lora:
            check_lora(vit, lora)
        for i, blk in enumerate(vit.blocks):
            h = adapted_block(blk, h, prefix.get(i), lora.get(i)) if i in prefix or i in lora else blk(h)
        return vit.norm(h)

    def patch_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The patch embedding's tokens (B, N, d) before positions and class token (cached for a CNN stem)."""
        vit = self.vit
        return vit.patch_embed(x) if self.stem_cache is None else self.stem_cache(x, vit.patch_embed)

    def _embed(self, x: torch.Tensor, spec: PromptSpec | None) -> torch.Tensor:
        vit = self.vit
        h = vit.patch_drop(vit._pos_embed(self.patch_tokens(x)))
        if spec is None or spec.tokens is None:
            return h
        t = _expand(spec.tokens, h.shape[0]).to(h.dtype)
        if spec.token_pos_embed is not None:
            t = t + spec.token_pos_embed
        if spec.token_position == "prepend":
            npre = self.num_prefix_tokens
            return torch.cat([h[:, :npre], t, h[:, npre:]], dim=1)
        return torch.cat([h, t], dim=1)

    def forward(self, x: torch.Tensor, spec: PromptSpec | None = None) -> torch.Tensor:
        return self.vit.forward_head(self.tokens(x, spec), pre_logits=True)

    @torch.no_grad()
    def query(self, x: torch.Tensor) -> torch.Tensor:
        """q(x): the unprompted feature, the query of pool-based prompt methods (cached when enabled)."""
        if self.query_cache is not None:
            return self.query_cache(x, self.forward)
        return self.forward(x, None)

    def enable_query_cache(self, on: bool = True) -> None:
        """Share one query cache among every model on this backbone (idempotent), or drop it."""
        if not on:
            self.query_cache = None
        elif self.query_cache is None:
            self.query_cache = QueryCache()


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise BackboneError(
            f"backbone weights file {path} not found; set backbone.weights to an existing "
            ".safetensors or torch checkpoint"
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        obj: Any = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling refusal becomes a clear message
        raise BackboneError(f"{path} is not a weights-only torch checkpoint ({e}); convert it to safetensors") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise BackboneError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return obj


def build_vit(cfg: BackboneConfig) -> FrozenViT:
    """Create the timm model and load weights from the hub (`pretrained`) or a local file (`weights`)."""
    import timm

    kwargs = dict(cfg.kwargs)
    kwargs.setdefault("img_size", cfg.img_size)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)  # a random-init backbone is a pure function of the config
            model = timm.create_model(cfg.name, pretrained=cfg.pretrained and not cfg.weights, num_classes=0, **kwargs)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise BackboneError(f"timm has no model {cfg.name!r}; `promptfcl list` shows ViT names") from None
        raise
    except Exception as e:  # noqa: BLE001 - hub download failures come in many exception types
        raise BackboneError(
            f"could not download pretrained weights for {cfg.name!r} ({type(e).__name__}: {e}). Offline, put "
            "the weights in a local .safetensors file and set backbone.weights: PATH and backbone.pretrained: false"
        ) from None
    if cfg.weights:
        state = {k: v for k, v in read_state_dict(Path(cfg.weights)).items() if not k.startswith("head.")}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("head.")]
        if missing or unexpected:
            raise BackboneError(
                f"{cfg.weights} does not fit {cfg.name} (img_size {cfg.img_size}): missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
    return FrozenViT(model, cfg.stem_cache_mb if cfg.stem_cache else None, cfg.stem_channels_last)


def stem_cache_for(backbone: object, transform: ImageTransform) -> AbstractContextManager[None]:
    """The context to run `transform`'s images through `backbone` in: a `FrozenViT`'s stem cache paused when the
    transform never repeats an input (a random crop), every other backbone and transform as it is."""
    if isinstance(backbone, FrozenViT) and not transform.repeats:
        return backbone.stem_cache_paused()
    return nullcontext()
