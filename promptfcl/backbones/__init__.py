"""Frozen backbones with prompt hooks."""

from promptfcl.backbones.prompt_spec import LORA_TARGETS, LoRADelta, PromptSpec
from promptfcl.backbones.vit import BackboneError, FrozenViT, build_vit

__all__ = ["LORA_TARGETS", "BackboneError", "FrozenViT", "LoRADelta", "PromptSpec", "build_vit"]
