"""Learnable prompt modules; each produces a `PromptSpec` for the frozen backbone."""

from promptfcl.prompts.prefix import PrefixPrompt

__all__ = ["PrefixPrompt"]
