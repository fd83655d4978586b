"""Parameter-efficient modules other than prompts (LoRA) that produce a `PromptSpec` for the frozen backbone."""

from promptfcl.adapters.lora import FixedDeltas, LoRAAdapter, Site, lora_sites, lora_spec, site_key, site_shape

__all__ = ["FixedDeltas", "LoRAAdapter", "Site", "lora_sites", "lora_spec", "site_key", "site_shape"]
