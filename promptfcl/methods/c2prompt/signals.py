"""C2Prompt's validity signals: LCDC and CPA are on (`lcdc_on`, `cpa_on`); LCDC's compensation prompts bring the
features closer to the global class Gaussians than the unprompted ones (`lcdc`: NLL after LCDC < unprompted NLL,
means over rounds); CPA mixes beyond FedAvg (`cpa_mixes`); and the prompts help (`validity.prompt_mechanism`)."""

from __future__ import annotations

from promptfcl.evaluation.validity import Check, RunEvidence, mean, series, switch_on


def check_lcdc(run: RunEvidence) -> Check | None:
    after, unprompted = series(run.rounds, "lcdc_nll_after"), series(run.rounds, "lcdc_nll_unprompted")
    if not after or not unprompted:
        return None
    gap = mean(unprompted) - mean(after)
    return Check(
        "lcdc", gap, "> 0 (unprompted NLL − NLL after LCDC, mean over rounds)", gap > 0,
        f"NLL {mean(unprompted):.2f} unprompted → {mean(after):.2f} with compensation",
    )  # fmt: skip


lcdc_on = switch_on("lcdc_on", "lcdc", "local class distribution compensation")
cpa_on = switch_on("cpa_on", "cpa", "class-aware prompt aggregation")


def check_cpa_mixes(run: RunEvidence) -> Check | None:
    """CPA mixes the clients' components beyond what FedAvg would: the share a client keeps from its own
    components (`cpa_own_client_weight`, mean over rounds) differs from FedAvg's 1/K by at least 5 % of it."""
    own, clients = series(run.rounds, "cpa_own_client_weight"), series(run.rounds, "clients")
    if not run.method().get("cpa", True):
        return None  # `cpa_on` already fails
    if not own or not clients:
        return Check("cpa_mixes", None, "CPA weights logged", False, "no cpa_own_client_weight in the round log")
    fedavg = 1.0 / mean(clients)
    value = mean(own) / fedavg
    return Check("cpa_mixes", value, "|own-client weight / FedAvg's 1/K − 1| ≥ 0.05", abs(value - 1) >= 0.05,
                 f"own-client weight {mean(own):.3f}, FedAvg {fedavg:.3f}")  # fmt: skip
