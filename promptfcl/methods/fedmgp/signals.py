"""FedMGP's validity signals: its fine local prompts are on (`local_prompts_on`) and chosen by key better than
chance at test time.

`key_hit`: the test-time local-prompt hit rate (the share of test images whose own class's local prompt is among
those their key picks, `diag/local_key_hit`) at least `KEY_HIT_FACTOR` × the rate a random pick would have
(`diag/local_key_chance`), at the last evaluation.
"""

from __future__ import annotations

from promptfcl.evaluation.validity import Check, RunEvidence, series, switch_on

KEY_HIT_FACTOR = 2.0


def check_key_hit(run: RunEvidence) -> Check | None:
    hits, chance = series(run.rounds, "diag/local_key_hit"), series(run.rounds, "diag/local_key_chance")
    if not hits or not chance:
        return None
    ratio = hits[-1] / chance[-1] if chance[-1] > 0 else float("inf")
    return Check(
        "key_hit", ratio, f"≥ {KEY_HIT_FACTOR:g} × chance (last evaluation)", ratio >= KEY_HIT_FACTOR,
        f"hit {hits[-1]:.1f} %, chance {chance[-1]:.1f} %",
    )  # fmt: skip


local_prompts_on = switch_on("local_prompts_on", "local_prompt", "fine class-wise local prompts routed by key")
