"""Frozen backbones with prompt hooks."""

from promptfcl.backbones import hybrid  # noqa: F401  (registers vit_tiny_hybrid_lite0 with timm)
from promptfcl.backbones.prompt_spec import LORA_TARGETS, LoRADelta, PromptSpec
from promptfcl.backbones.vit import BackboneError, FrozenViT, build_vit

__all__ = ["LORA_TARGETS", "BackboneError", "FrozenViT", "LoRADelta", "PromptSpec", "build_vit"]
