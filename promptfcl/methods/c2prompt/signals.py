"""C2Prompt's validity signal: LCDC's compensation prompts must bring the features closer to the global class
Gaussians than the unprompted ones (`lcdc`: NLL after LCDC < unprompted NLL, means over rounds)."""

from __future__ import annotations

from promptfcl.evaluation.validity import Check, RunEvidence, mean, series


def check_lcdc(run: RunEvidence) -> Check | None:
    after, unprompted = series(run.rounds, "lcdc_nll_after"), series(run.rounds, "lcdc_nll_unprompted")
    if not after or not unprompted:
        return None
    gap = mean(unprompted) - mean(after)
    return Check(
        "lcdc", gap, "> 0 (unprompted NLL − NLL after LCDC, mean over rounds)", gap > 0,
        f"NLL {mean(unprompted):.2f} unprompted → {mean(after):.2f} with compensation",
    )  # fmt: skip
