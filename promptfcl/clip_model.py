"""`ClipClassifier`: a frozen CLIP classifying by cosine similarity between image and class-text features.

The backbone is any `ClipTowers`: open_clip's `FrozenCLIP`, or the CPU-scale stand-in `MiniCLIP`.

What is learnable (and so what travels) is chosen by `ClipPromptParams`:

- `n_ctx` general context vectors P_g (M, w) in front of every class name (CoOp, PromptFL; CAPT's general prompt);
- `class_ctx` per-class context vectors P_c (C, T, w) (CAPT's class-aware prompts), one row per class;
- `depth` J > 1: MaPLe's deep language prompts — layers 1..J−1 of the text encoder get their own general
  context (J−1, M, w) at the positions of P_g;
- `coupling`: MaPLe's coupling function F, one Linear(w_text → w_vision) per depth, mapping the general text
  prompt of layer j to the vision prompt of layer j (CAPT Eq. 3: z' = f([x, F(P_g)]));
- `adapter_hidden`: FedCLIP's attention adapter on the image feature, softmax(W2 tanh(W1 z)) ⊙ z;
- `conditional`: CoCoOp's meta-net Linear(e, e/16)–ReLU–Linear(e/16, w) on the image feature, whose output is
  added to every general context vector, so each image gets its own class texts (B × C text-encoder passes).

Text sequences are the CoOp layout `[SOS] [P_g] [P_c^i] CLASS_i . [EOS]`: placeholder tokens whose embeddings are
replaced by the context vectors. With no learnable text context the class texts are the fixed `template`
("a photo of a {}.", zero-shot CLIP and FedCLIP) and their features are computed once.
Logits: CLIP's (frozen) logit scale × cosine(image feature, text feature).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from promptfcl.backbones.clip_towers import ClipTowers
from promptfcl.model import ExchangedModel

Variant = Literal["general", "class", "integrated", "fixed"]
Inference = Literal["auto", "general", "class", "ensemble", "integrated"]


class ClipPromptParams(BaseModel):
    """The learnable parts of a CLIP prompt model (each CLIP method sets its paper's defaults)."""

    model_config = ConfigDict(extra="forbid")
    n_ctx: int = Field(4, ge=0, description="M: general context tokens (CoOp / PromptFL / CAPT P_g); 0 = none")
    class_ctx: int = Field(0, ge=0, description="T: per-class context tokens (CAPT P_c); 0 = none")
    depth: int = Field(1, ge=1, description="J: prompted layers (MaPLe deep prompts in layers 0..J-1)")
    coupling: bool = Field(False, description="vision prompts F_j(P_g^j) in the image encoder (MaPLe coupling)")
    ctx_init: str | None = Field("a photo of a", description="initialise contexts from these words when lengths fit")
    template: str = Field("a photo of a {}.", description="class text when no context is learned")
    adapter_hidden: int | None = Field(None, gt=0, description="FedCLIP attention adapter hidden size")
    conditional: bool = Field(False, description="CoCoOp: a meta-net shifts the general context by π(image)")
    inference: Inference = Field(
        "auto", description="text features at test time; auto: general, class or ensemble by what exists"
    )


def _texts(prefix_tokens: int, names: list[str]) -> list[str]:
    ph = " ".join(["X"] * prefix_tokens)
    return [f"{ph} {n}." if ph else f"{n}." for n in names]


class ClipClassifier(ExchangedModel):
    """Frozen CLIP (by reference, not a submodule) + learnable contexts / coupling / adapter."""

    GENERAL = ("ctx", "deep_ctx")
    CLASS = ("class_ctx",)

    def __init__(self, backbone: ClipTowers, class_names: list[str], p: ClipPromptParams) -> None:
        super().__init__()
        object.__setattr__(self, "backbone", backbone)
        if p.depth > min(backbone.text_layers, backbone.vision_layers):
            raise ValueError(f"depth {p.depth} exceeds the CLIP encoders' layers")
        if p.conditional and (p.n_ctx == 0 or p.class_ctx or p.coupling or p.depth > 1):
            raise ValueError("conditional (CoCoOp) contexts need n_ctx > 0 and no class_ctx, coupling or depth")
        if p.coupling and p.n_ctx == 0:
            raise ValueError("the coupling maps the general prompt to vision prompts: it needs n_ctx > 0")
        self.p = p
        self.num_classes = len(class_names)
        names = [n.replace("_", " ") for n in class_names]
        w, device = backbone.text_width, backbone.device
        texts: dict[str, list[str]] = {}
        if p.n_ctx:
            texts["general"] = _texts(p.n_ctx, names)
        if p.class_ctx:
            texts["class"] = _texts(p.class_ctx, names)
        if p.n_ctx and p.class_ctx:
            texts["integrated"] = _texts(p.n_ctx + p.class_ctx, names)
        texts["fixed"] = [p.template.format(n) for n in names]  # the zero-shot texts (also the prompt-free pass's)
        for v, t in texts.items():
            tokens = backbone.tokenize(t)
            self.register_buffer(f"tokens_{v}", tokens, persistent=False)
            self.register_buffer(f"embeds_{v}", backbone.token_embeddings(tokens), persistent=False)
        self.variants = tuple(texts)
        init = self._init_words(p.ctx_init)
        if p.n_ctx:
            self.ctx = nn.Parameter(self._init(init, p.n_ctx, w, device))
            if p.depth > 1:
                self.deep_ctx = nn.Parameter(torch.randn(p.depth - 1, p.n_ctx, w, device=device) * 0.02)
        if p.class_ctx:
            self.class_ctx = nn.Parameter(self._init(init, p.class_ctx, w, device).expand(len(names), -1, -1).clone())
        if p.coupling:
            self.coupling = nn.ModuleList(nn.Linear(w, backbone.vision_width) for _ in range(p.depth)).to(device)
        if p.adapter_hidden:
            e = backbone.embed_dim
            self.adapter = nn.Sequential(
                nn.Linear(e, p.adapter_hidden), nn.Tanh(), nn.Linear(p.adapter_hidden, e), nn.Softmax(dim=1)
            ).to(device)
        if p.conditional:
            e, hidden = backbone.embed_dim, max(1, backbone.embed_dim // 16)
            self.meta_net = nn.Sequential(nn.Linear(e, hidden), nn.ReLU(), nn.Linear(hidden, w)).to(device)
        self._fixed: torch.Tensor | None = None
        self._no_grad_text: dict[str, tuple[tuple, torch.Tensor]] = {}

    def _init_words(self, words: str | None) -> torch.Tensor | None:
        if not words:
            return None
        tokens = self.backbone.tokenize([words])
        n = int(self.backbone.eot_index(tokens)[0]) - 1
        return self.backbone.token_embeddings(tokens)[0, 1 : 1 + n]

    @staticmethod
    def _init(words: torch.Tensor | None, n: int, w: int, device: torch.device) -> torch.Tensor:
        """CoOp / MaPLe initialisation: the first n word embeddings when there are at least n, else N(0, 0.02²)."""
        if words is not None and words.shape[0] >= n:
            return words[:n].clone()
        return torch.randn(n, w, device=device) * 0.02

    @property
    def inference(self) -> str:
        if self.p.inference != "auto":
            return self.p.inference
        if "general" in self.variants and "class" in self.variants:
            return "ensemble"
        return "general" if "general" in self.variants else ("class" if "class" in self.variants else "fixed")

    # ------------------------------------------------------------------------------------------ parts
    def general_layers(self) -> list[torch.Tensor]:
        """P_g of every prompted layer: [ctx, deep_ctx[0], ...]."""
        layers = [self.ctx]
        if hasattr(self, "deep_ctx"):
            layers += list(self.deep_ctx.unbind(0))
        return layers

    def vision_prompts(self) -> dict[int, torch.Tensor] | None:
        """MaPLe coupling: the vision prompt of layer j is F_j(P_g^j)."""
        if not hasattr(self, "coupling"):
            return None
        return {j: f(pg) for j, (f, pg) in enumerate(zip(self.coupling, self.general_layers(), strict=True))}

    def conditional_text_features(self, z: torch.Tensor) -> torch.Tensor:
        """CoCoOp: per-image class-text features (B, C, e) from the context shifted by meta_net(z)."""
        embeds, tokens = self.embeds_general, self.tokens_general
        b, (c, length, w) = z.shape[0], embeds.shape
        ctx = self.ctx.unsqueeze(0) + self.meta_net(z).unsqueeze(1)  # (B, M, w)
        parts = [
            embeds[:, :1].unsqueeze(0).expand(b, -1, -1, -1),
            ctx.unsqueeze(1).expand(-1, c, -1, -1),
            embeds[:, 1 + ctx.shape[1] :].unsqueeze(0).expand(b, -1, -1, -1),
        ]
        flat = torch.cat(parts, dim=2).reshape(b * c, length, w)
        return self.backbone.encode_text(flat, tokens.repeat(b, 1)).reshape(b, c, -1)

    def text_features(self, variant: Variant) -> torch.Tensor:
        """Normalised class-text features (C, e) of one prompt variant."""
        if variant == "fixed":
            if self._fixed is None or self._fixed.device != self.tokens_fixed.device:
                with torch.no_grad():
                    self._fixed = self.backbone.encode_text(self.embeds_fixed, self.tokens_fixed)
            return self._fixed
        if variant not in self.variants:
            raise ValueError(f"this model has no {variant!r} text prompts (it has {self.variants})")
        if torch.is_grad_enabled():
            return self._encode_variant(variant)
        # no-grad passes (evaluation, statistics) encode each variant's class texts once, not once per image batch:
        # the features depend only on this module's own tensors (the towers are frozen), so the key is their
        # identity, storage, in-place version and sum (the sum catches writes through `.data`, which skip the version)
        key = tuple((id(t), t.data_ptr(), t._version, float(t.sum())) for t in (*self.parameters(), *self.buffers()))
        cached = self._no_grad_text.get(variant)
        if cached is None or cached[0] != key:
            cached = (key, self._encode_variant(variant))
            self._no_grad_text[variant] = cached
        return cached[1]

    def _encode_variant(self, variant: Variant) -> torch.Tensor:
        embeds: torch.Tensor = getattr(self, f"embeds_{variant}")
        tokens: torch.Tensor = getattr(self, f"tokens_{variant}")
        c = embeds.shape[0]
        parts = [embeds[:, :1]]
        if variant in ("general", "integrated"):
            parts.append(self.ctx.unsqueeze(0).expand(c, -1, -1))
        if variant in ("class", "integrated"):
            parts.append(self.class_ctx)
        n = sum(q.shape[1] for q in parts[1:])
        embeds = torch.cat([*parts, embeds[:, 1 + n :]], dim=1)
        deep = None
        if variant != "class" and hasattr(self, "deep_ctx"):
            deep = {j + 1: (1, d) for j, d in enumerate(self.deep_ctx.unbind(0))}
        return self.backbone.encode_text(embeds, tokens, deep)

    def image_features(self, x: torch.Tensor) -> torch.Tensor:
        z = self.backbone.encode_image(x, self.vision_prompts())
        if hasattr(self, "adapter"):
            z = F.normalize(self.adapter(z) * z, dim=-1)
        return z

    def cosine_logits(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.backbone.logit_scale * z @ t.t()

    @property
    def prompted(self) -> bool:
        """Whether anything is learned beside zero-shot CLIP (contexts, coupling, adapter, meta-net)."""
        return any(q.numel() for q in self.parameters())

    def zero_shot(self, x: torch.Tensor) -> torch.Tensor:
        """Zero-shot CLIP's logits: the template's class texts and the prompt-free image features."""
        return self.cosine_logits(self.backbone.encode_image(x), self.text_features("fixed"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backbone.prompts_off:  # the validity gate's prompt-free pass (`ClipTowers.prompts_disabled`)
            return self.zero_shot(x)
        z = self.image_features(x)
        if hasattr(self, "meta_net"):
            return self.backbone.logit_scale * torch.einsum("be,bce->bc", z, self.conditional_text_features(z))
        mode = self.inference
        if mode == "ensemble":
            general = self.cosine_logits(z, self.text_features("general"))
            return 0.5 * (general + self.cosine_logits(z, self.text_features("class")))
        return self.cosine_logits(z, self.text_features(mode))  # type: ignore[arg-type]

    def part_names(self, part: str) -> list[str]:
        """State names of P_g ('general'), P_c ('class') or F ('coupling')."""
        keys = list(self.state_dict())
        if part == "general":
            return [k for k in keys if k in self.GENERAL]
        if part == "class":
            return [k for k in keys if k in self.CLASS]
        if part == "coupling":
            return [k for k in keys if k.startswith("coupling.")]
        raise ValueError(f"unknown part {part!r}")
