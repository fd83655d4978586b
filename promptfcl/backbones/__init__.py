"""Frozen backbones with prompt hooks."""

from promptfcl.backbones.prompt_spec import PromptSpec
from promptfcl.backbones.vit import BackboneError, FrozenViT, build_vit

__all__ = ["BackboneError", "FrozenViT", "PromptSpec", "build_vit"]
