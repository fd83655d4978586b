"""Learnable prompt modules; each produces a `PromptSpec` for the frozen backbone."""

from promptfcl.prompts.codap import CodaPool
from promptfcl.prompts.dualprompt import DualPromptPool
from promptfcl.prompts.l2p import L2PPool
from promptfcl.prompts.pools import PromptPool
from promptfcl.prompts.prefix import PrefixPrompt
from promptfcl.prompts.weighted_pool import WeightedPool

__all__ = ["CodaPool", "DualPromptPool", "L2PPool", "PrefixPrompt", "PromptPool", "WeightedPool"]
