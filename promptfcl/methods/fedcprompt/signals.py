"""Fed-CPrompt's validity signal: its contrastive continual loss (C2L) is on (`c2l_weight` > 0)."""

from __future__ import annotations

from promptfcl.evaluation.validity import switch_on

c2l_on = switch_on("c2l_on", "c2l_weight", "the contrastive continual loss")
