"""HePCo's validity signals: its server-side generators and distillation must do what they are for.

- `generator_fidelity`: the client heads classify the generator's latents as their conditioning label at least a
  `MIN_FIDELITY` fraction of the time (mean over rounds): latents that no teacher recognises teach nothing.
- `stage_a`: prompt distillation moves the prompts by at least `MIN_STAGE_A` of the round's FedAvg move and lowers
  its loss (means over rounds).
- `distillation_on` / `distillation_mechanism`: the server's consolidation is on (`server_kd`), and the final model
  predicts the test set better than itself before the last round's consolidation (McNemar).
"""

from __future__ import annotations

from promptfcl.evaluation.validity import Check, RunEvidence, component_mechanism, mean, series, switch_on

MIN_FIDELITY = 0.5  # a fraction of the generated latents
MIN_STAGE_A = 0.05


def check_generator_fidelity(run: RunEvidence) -> Check | None:
    v = series(run.rounds, "generator_fidelity")
    if not v:
        return None
    m = mean(v)
    return Check("generator_fidelity", m, f"≥ {MIN_FIDELITY:g} of latents (mean over rounds)", m >= MIN_FIDELITY)


def check_stage_a(run: RunEvidence) -> Check | None:
    move = series(run.rounds, "stage_a_vs_fedavg")
    first, last = series(run.rounds, "stage_a_loss_first"), series(run.rounds, "stage_a_loss_last")
    if not move:
        return None
    m = mean(move)
    lowered = bool(first and last) and mean(last) < mean(first)
    return Check(
        "stage_a", m, f"≥ {MIN_STAGE_A:g} × the FedAvg move and a lower distillation loss (mean over rounds)",
        m >= MIN_STAGE_A and lowered,
        f"loss {mean(first):.4g} → {mean(last):.4g}" if first and last else "",
    )  # fmt: skip


distillation_on = switch_on("distillation_on", "server_kd", "the server's data-free distillation")
distillation_mechanism = component_mechanism("distillation", "the server's data-free distillation")
