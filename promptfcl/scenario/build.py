"""`build_scenario`: the one dispatch from `scenario.kind` to its family's builder."""

from __future__ import annotations

import numpy as np

from promptfcl.config import ScenarioConfig
from promptfcl.data.domains import draw_domains
from promptfcl.scenario.asynchronous import build_asynchronous
from promptfcl.scenario.class_incremental import build_class_incremental
from promptfcl.scenario.long_tail import build_long_tailed
from promptfcl.scenario.personalized import build_personalized
from promptfcl.scenario.scenario import Scenario
from promptfcl.scenario.upper_bound import upper_bound_scenario


def build_scenario(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    """The scenario family `cfg.kind` names (the one dispatch point for scenario builders), in its centralized or
    joint upper-bound form when `cfg.upper_bound` is set (`promptfcl.scenario.upper_bound`), with each client's
    image domain when `cfg.domains` is set (`promptfcl.data.domains`)."""
    scenario = _build_family(cfg, train_targets, test_targets, num_classes, seed)
    if cfg.domains is not None:
        scenario.domains = draw_domains(cfg.domains, scenario.num_clients, seed)
    return scenario


def _build_family(
    cfg: ScenarioConfig, train_targets: np.ndarray, test_targets: np.ndarray, num_classes: int, seed: int
) -> Scenario:
    if cfg.upper_bound is not None:
        federated = build_scenario(
            cfg.model_copy(update={"upper_bound": None}), train_targets, test_targets, num_classes, seed
        )
        return upper_bound_scenario(federated, cfg, cfg.upper_bound)
    if cfg.kind == "asynchronous":
        return build_asynchronous(cfg, train_targets, test_targets, num_classes, seed)
    if cfg.kind == "long_tailed":
        return build_long_tailed(cfg, train_targets, test_targets, num_classes, seed)
    if cfg.kind == "personalized":
        return build_personalized(cfg, train_targets, test_targets, num_classes, seed)
    return build_class_incremental(cfg, train_targets, test_targets, num_classes, seed)
