"""The hybrid CPU-scale backbone: ViT-Tiny on a frozen ImageNet EfficientNet-Lite0 stem, as a timm model name.

`vit_tiny_hybrid_lite0` is a timm `VisionTransformer` (12 standard `Block`s, width 192, 3 heads, class token,
final norm) whose patch embedding is a `HybridEmbed` over EfficientNet-Lite0's layers up to stride 16 (timm
`tf_efficientnet_lite0`, `features_only`, `out_indices=(3,)`: 112 channels, a 7×7 map at 112 px), projected 1×1 to
192 — the construction of `../shared/assets/models/README.md`. Registering it with timm makes it a config value
like any ViT (`backbone.name: vit_tiny_hybrid_lite0`), so every prompt hook applies unchanged: the stem sits before
the first block, where a plain ViT has its patch projection.

No hub weights exist for it: the distilled checkpoint is a local file
(`backbone.weights: .../vit_tiny_hybrid_lite0_112_distilled.safetensors`, which holds the stem too). Because the
stem is frozen and comes before every prompt, its output for an image (and its flip) never changes: `FrozenViT`
caches it (`backbone.stem_cache`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from timm.layers import HybridEmbed
from timm.models import register_model
from timm.models.vision_transformer import VisionTransformer

HYBRID_WEIGHTS = "vit_tiny_hybrid_lite0_112_distilled.safetensors"


@register_model
def vit_tiny_hybrid_lite0(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """ViT-Tiny over the frozen EfficientNet-Lite0 stride-16 stem (default 112 px input, a 7×7 token grid)."""
    import timm

    if pretrained:
        raise RuntimeError(
            f"no hub weights exist for vit_tiny_hybrid_lite0; set backbone.weights to the local {HYBRID_WEIGHTS} "
            "(in the shared assets' models/ folder) and backbone.pretrained: false"
        )
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    stem = timm.create_model("tf_efficientnet_lite0", pretrained=False, features_only=True, out_indices=(3,))
    args: dict[str, Any] = {
        "img_size": 112,
        "patch_size": 1,  # over the stem's feature map: each token covers 16×16 input pixels
        "embed_dim": 192,
        "depth": 12,
        "num_heads": 3,
        "num_classes": 0,
        **kwargs,
    }
    return VisionTransformer(embed_layer=partial(HybridEmbed, backbone=stem), **args)


def has_stem(vit: Any) -> bool:
    """True when the ViT's patch embedding is a (frozen) CNN stem, whose output is worth caching."""
    return isinstance(getattr(vit, "patch_embed", None), HybridEmbed)
