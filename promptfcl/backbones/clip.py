"""A frozen open_clip CLIP with prompt hooks: learnable text-token embeddings and deep vision/text prompts.

Optional (`pip install 'promptfcl[clip]'`): this module imports `open_clip` only when a CLIP backbone is built
(`backbone.kind: clip`), so the core never needs it.

- Text side (CoOp / MaPLe): `encode_text(embeds, tokens, deep)` runs CLIP's text transformer on token
  embeddings in which learnable context vectors have replaced placeholder tokens; `deep[layer] = (start, P)`
  replaces the tokens at `start : start + len(P)` with `P` at the input of transformer layer `layer ≥ 1`
  (MaPLe's deep language prompts). Sequences are cut after the last end-of-text token: under CLIP's causal mask
  the later positions cannot change the end-of-text feature, so the result equals the full-length forward.
- Vision side (MaPLe): `encode_image(x, prompts)` appends `prompts[0]` (n, width) as tokens after the patch
  tokens (before `ln_pre`, as MaPLe does) and replaces them with `prompts[j]` at the input of layer `j ≥ 1`.
  Without prompts the output equals open_clip's `encode_image`.

Weights: `backbone.pretrained: true` asks open_clip for `backbone.tag` (e.g. `openai`; needs internet), or
`backbone.weights: FILE` loads a local `.safetensors` or weights-only torch checkpoint (e.g. the
`open_clip_model.safetensors` of the `timm/vit_base_patch16_clip_224.openai` hub repository). Neither: random
init from the open_clip model config of `backbone.name` deep-merged with `backbone.kwargs` (the tests' tiny CLIP).

`backbone.name: mini-clip` is not an open_clip model but the CPU-scale stand-in `promptfcl.backbones.mini_clip.MiniCLIP`
(frozen hybrid ViT-Tiny + frozen MiniLM text tower + a label-free image→text projection), which needs no open_clip.
Both are `ClipTowers`, the interface `promptfcl.clip_model.ClipClassifier` and the CLIP methods use.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from promptfcl.backbones.clip_towers import ClipTowers
from promptfcl.backbones.precision import Precision, autocast
from promptfcl.backbones.vit import BackboneError, read_state_dict
from promptfcl.config import BackboneConfig

CLIP_MISSING = (
    "backbone.kind: clip needs open_clip; install the optional extra with `pip install 'promptfcl[clip]'` "
    "(or `pip install open_clip_torch scikit-learn`)"
)


def import_open_clip() -> Any:
    try:
        import open_clip
    except ImportError:
        raise BackboneError(CLIP_MISSING) from None
    return open_clip


def _deep_merge(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in updates.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def is_mini_clip(cfg: BackboneConfig) -> bool:
    """True when `backbone.name` selects the CPU-scale stand-in mini-CLIP instead of an open_clip model."""
    from promptfcl.backbones.mini_clip import MINI_CLIP

    return cfg.name == MINI_CLIP


def clip_model_config(cfg: BackboneConfig) -> dict[str, Any]:
    """open_clip's architecture config of `cfg.name`, deep-merged with `cfg.kwargs` (mini-CLIP: its checked
    options, files and packages included)."""
    if is_mini_clip(cfg):
        from promptfcl.backbones.mini_clip import check_mini_clip

        return check_mini_clip(cfg).model_dump()
    open_clip = import_open_clip()
    base = open_clip.get_model_config(cfg.name)
    if base is None:
        raise BackboneError(
            f"open_clip has no model config {cfg.name!r} (try ViT-B-16, ViT-B-32, RN50; "
            "`python -c 'import open_clip; print(open_clip.list_models())'` lists them)"
        )
    return _deep_merge(base, cfg.kwargs)


class FrozenCLIP(ClipTowers):
    """Frozen open_clip `CLIP` (image + text towers) with prompt hooks; always in eval mode, nothing trainable."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        open_clip = import_open_clip()
        if not isinstance(model, open_clip.model.CLIP):
            raise BackboneError(f"{type(model).__name__} is not an open_clip CLIP (custom-text towers unsupported)")
        if not isinstance(model.visual, open_clip.transformer.VisionTransformer):
            raise BackboneError("deep vision prompts need a ViT image tower (not a ResNet)")
        self.clip = model.eval()
        for p in self.clip.parameters():
            p.requires_grad_(False)
        self._tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=model.context_length)
        self.configure()

    # ------------------------------------------------------------------------------------------ shape
    @property
    def text_width(self) -> int:
        return int(self.clip.token_embedding.weight.shape[1])

    @property
    def vision_width(self) -> int:
        return int(self.clip.visual.conv1.out_channels)

    @property
    def embed_dim(self) -> int:
        return int(self.clip.visual.output_dim)

    @property
    def text_layers(self) -> int:
        return len(self.clip.transformer.resblocks)

    @property
    def vision_layers(self) -> int:
        return len(self.clip.visual.transformer.resblocks)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.clip.logit_scale.exp()

    @property
    def device(self) -> torch.device:
        return self.clip.token_embedding.weight.device

    # ------------------------------------------------------------------------------------------- text
    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """Token ids (N, context_length) with open_clip's BPE vocabulary (shipped in the package, offline)."""
        return self._tokenizer(texts).to(self.clip.token_embedding.weight.device)

    def eot_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Position of each sequence's end-of-text token (the largest id of CLIP's vocabulary)."""
        return tokens.argmax(dim=-1)

    @torch.no_grad()
    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.clip.token_embedding(tokens)

    def _blocks(self, transformer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None, hook: Any) -> torch.Tensor:
        batch_first = getattr(transformer, "batch_first", True)
        for i, blk in enumerate(transformer.resblocks):
            x = hook(i, x)
            x = blk(x, attn_mask=mask) if batch_first else blk(x.transpose(0, 1), attn_mask=mask).transpose(0, 1)
        return x

    def configure(self, precision: Precision = "fp32", compile: bool = False) -> None:
        """Run both towers under `precision`'s autocast (`backbones.precision`), through `torch.compile` if asked."""
        self.precision = precision
        self._text = torch.compile(FrozenCLIP._encode_text) if compile else FrozenCLIP._encode_text
        self._image = torch.compile(FrozenCLIP._encode_image) if compile else FrozenCLIP._encode_image

    def encode_text(
        self,
        embeds: torch.Tensor,
        tokens: torch.Tensor,
        deep: dict[int, tuple[int, torch.Tensor]] | None = None,
        normalize: bool = True,
    ) -> torch.Tensor:
        """Text features (N, embed_dim), float32, from token embeddings (N, L, w) whose ids are `tokens` (N, L)."""
        with autocast(embeds.device.type, self.precision):
            return self._text(self, embeds, tokens, deep, normalize).float()

    def _encode_text(
        self,
        embeds: torch.Tensor,
        tokens: torch.Tensor,
        deep: dict[int, tuple[int, torch.Tensor]] | None,
        normalize: bool,
    ) -> torch.Tensor:
        m = self.clip
        eot = tokens.argmax(dim=-1)
        length = int(eot.max()) + 1  # causal mask: positions after the last EOT never reach an EOT feature
        x = embeds[:, :length] + m.positional_embedding[:length].to(embeds.dtype)
        mask = m.attn_mask[:length, :length] if m.attn_mask is not None else None
        deep = deep or {}

        def hook(i: int, h: torch.Tensor) -> torch.Tensor:
            if i == 0 or i not in deep:
                return h
            start, p = deep[i]
            p = p.to(h.dtype).unsqueeze(0).expand(h.shape[0], -1, -1)
            return torch.cat([h[:, :start], p, h[:, start + p.shape[1] :]], dim=1)

        x = self._blocks(m.transformer, x, mask, hook)
        x = m.ln_final(x)
        x = x[torch.arange(x.shape[0], device=x.device), eot]
        if m.text_projection is not None:
            x = m.text_projection(x) if isinstance(m.text_projection, nn.Linear) else x @ m.text_projection
        return F.normalize(x, dim=-1) if normalize else x

    # ------------------------------------------------------------------------------------------ image
    def encode_image(
        self, x: torch.Tensor, prompts: dict[int, torch.Tensor] | None = None, normalize: bool = True
    ) -> torch.Tensor:
        """Image features (B, embed_dim), float32; `prompts[j]` (n, width) are MaPLe's deep vision prompts of
        layer j."""
        with autocast(x.device.type, self.precision):
            return self._image(self, x, prompts, normalize).float()

    def _encode_image(self, x: torch.Tensor, prompts: dict[int, torch.Tensor] | None, normalize: bool) -> torch.Tensor:
        v = self.clip.visual
        if not prompts:
            out = v(x)
            return F.normalize(out, dim=-1) if normalize else out
        if 0 not in prompts:
            raise ValueError("deep vision prompts need the layer-0 prompt (the tokens that later layers replace)")
        h = v.conv1(x.to(v.conv1.weight.dtype))
        h = h.reshape(h.shape[0], h.shape[1], -1).permute(0, 2, 1)
        cls = v.class_embedding.to(h.dtype).view(1, 1, -1).expand(h.shape[0], -1, -1)
        h = torch.cat([cls, h], dim=1) + v.positional_embedding.to(h.dtype)
        h = v.patch_dropout(h)
        n = prompts[0].shape[0]
        h = torch.cat([h, prompts[0].to(h.dtype).unsqueeze(0).expand(h.shape[0], -1, -1)], dim=1)
        h = v.ln_pre(h)

        def hook(i: int, t: torch.Tensor) -> torch.Tensor:
            if i == 0 or i not in prompts:
                return t
            p = prompts[i].to(t.dtype).unsqueeze(0).expand(t.shape[0], -1, -1)
            return torch.cat([t[:, :-n], p], dim=1)

        h = self._blocks(v.transformer, h, None, hook)
        pooled, _ = v._pool(h)
        if v.proj is not None:
            pooled = pooled @ v.proj
        return F.normalize(pooled, dim=-1) if normalize else pooled


def build_clip(cfg: BackboneConfig) -> ClipTowers:
    """Create the open_clip model: pretrained tag (online), local weights file, or seeded random init; or the
    CPU-scale stand-in mini-CLIP (`backbone.name: mini-clip`)."""
    if is_mini_clip(cfg):
        from promptfcl.backbones.mini_clip import build_mini_clip

        return build_mini_clip(cfg)
    open_clip = import_open_clip()
    model_cfg = clip_model_config(cfg)
    if cfg.pretrained and not cfg.weights:
        try:
            model = open_clip.create_model(cfg.name, pretrained=cfg.tag, **cfg.kwargs)
        except Exception as e:  # noqa: BLE001 - hub download failures come in many exception types
            raise BackboneError(
                f"could not get open_clip weights {cfg.name!r}/{cfg.tag!r} ({type(e).__name__}: {e}). Offline, "
                "download them elsewhere (e.g. open_clip_model.safetensors of the Hugging Face repository "
                "timm/vit_base_patch16_clip_224.openai for ViT-B-16/openai), copy the file here and set "
                "backbone.weights: /path/to/open_clip_model.safetensors and backbone.pretrained: false "
                "(OpenAI weights also need backbone.kwargs.quick_gelu: true)"
            ) from None
        return FrozenCLIP(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)  # a random-init backbone is a pure function of the config
        try:
            model = open_clip.model.CLIP(**model_cfg)
        except TypeError as e:
            raise BackboneError(f"backbone.kwargs do not fit open_clip's CLIP config: {e}") from None
    if cfg.weights:
        state = read_state_dict(Path(cfg.weights))
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as e:  # shape mismatches
            raise BackboneError(f"{cfg.weights} does not fit open_clip {cfg.name} ({cfg.kwargs}): {e}") from None
        if missing or unexpected:
            raise BackboneError(
                f"{cfg.weights} does not fit open_clip {cfg.name} with kwargs {cfg.kwargs}: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
    return FrozenCLIP(model)
