"""PILoRA's validity signal: prototype re-weighting is active — the server weights the clients' prototypes of a class
by their distance to the clients' class features instead of equally (`proto_top_weight`, the mean largest weight,
above FedAvg's 1/K by at least 5 %). Whether its LoRA helps or hurts is the generic `prompt_benefit`."""

from __future__ import annotations

from promptfcl.evaluation.validity import Check, RunEvidence, mean, series


def check_reweighting(run: RunEvidence) -> Check | None:
    top, clients = series(run.rounds, "proto_top_weight"), series(run.rounds, "clients")
    if not top or not clients:
        return Check("reweighting", None, "prototype weights logged", False, "no proto_top_weight in the round log")
    ratio = mean(top) * mean(clients)
    return Check("reweighting", ratio, "≥ 1.05 (largest prototype weight × K; 1 = uniform)", ratio >= 1.05,
                 f"largest weight {mean(top):.3f} of {mean(clients):.1f} clients")  # fmt: skip
