"""CAPT's validity signals: its learned prompts beat zero-shot CLIP (`validity.prompt_mechanism`), its class-aware
prompts help beside the general ones (`class_prompts_mechanism`: the final model against itself reading only P_g,
McNemar), and its similarity clustering is on and groups clients whose label distributions are closer than random
groups of the same sizes (`clustering`: mean `sim_cluster_gain` ≥ `MIN_CLUSTER_GAIN`)."""

from __future__ import annotations

from promptfcl.evaluation.validity import Check, RunEvidence, component_mechanism, mean, series, switch_on

MIN_CLUSTER_GAIN = 0.05  # 1 − within-cluster distance / random groups'

class_prompts_mechanism = component_mechanism("class_prompts", "the class-aware prompts")
clustering_on = switch_on("clustering_on", "clustering", "client clustering")


def check_clustering(run: RunEvidence) -> Check | None:
    if not run.method().get("clustering", True):
        return None  # `clustering_on` already fails
    gains = series(run.rounds, "sim_cluster_gain")
    if not gains:
        return Check("clustering", None, "cluster gain logged", False, "no clustered round logged sim_cluster_gain")
    m = mean(gains)
    return Check("clustering", m, f"≥ {MIN_CLUSTER_GAIN:g} (1 − within-cluster / random-group distance, mean)",
                 m >= MIN_CLUSTER_GAIN, f"{len(gains)} clustered rounds")  # fmt: skip
