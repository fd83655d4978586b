"""The validity gate: a run that did not learn is flagged, prompt effects are measured, method signals are held to
their thresholds."""

from __future__ import annotations

import math

import pytest

from promptfcl.evaluation.validity import (
    LearnedTask,
    RunEvidence,
    binomial_tail,
    check_client_loss,
    check_learned_tasks,
    failed_checks,
    gate,
)
from promptfcl.experiment import Experiment
from promptfcl.methods import METHODS
from promptfcl.methods.c2prompt.signals import check_lcdc
from promptfcl.methods.fedmgp.signals import check_key_hit
from promptfcl.methods.hepco.signals import check_generator_fidelity, check_stage_a

from .conftest import tiny_config


def test_binomial_tail_matches_hand_computed_values() -> None:
    assert binomial_tail(2, 3, 0.5) == pytest.approx(0.5)  # (3 + 1) / 8
    assert binomial_tail(3, 3, 0.1) == pytest.approx(0.001)
    assert binomial_tail(0, 5, 0.3) == 1.0 and binomial_tail(6, 5, 0.3) == 0.0
    assert binomial_tail(1, 4, 0.25) == pytest.approx(1 - 0.75**4)
    from scipy import stats

    for k, n, p in [(35, 200, 0.1), (120, 1000, 0.1), (7, 20, 0.5), (60, 100, 0.02)]:
        assert binomial_tail(k, n, p) == pytest.approx(stats.binom.sf(k - 1, n, p), rel=1e-9, abs=1e-300)


@pytest.mark.slow
def test_a_run_with_lr_zero_is_flagged_invalid_and_a_trained_one_passes_the_learning_checks(tmp_path) -> None:
    results = {}
    for lr in (0.0, 0.01):
        cfg = tiny_config(method={"lr": lr, "local_epochs": 4})
        results[lr] = Experiment(cfg, tmp_path / str(lr), show_progress=False).run()["validity"]
    frozen, trained = results[0.0], results[0.01]
    assert not frozen["valid"]
    assert {"client_loss", "learned_tasks"} <= set(failed_checks(frozen))
    assert "client_loss" not in failed_checks(trained) and "learned_tasks" not in failed_checks(trained)
    assert "backbone_pretrained" in failed_checks(trained)  # the tiny test ViT is random-init: never valid evidence


@pytest.mark.slow
def test_prompt_effect_is_measured_on_prompted_models_and_not_applicable_to_head_only(tmp_path) -> None:
    prompted = Experiment(tiny_config(), tmp_path / "p", show_progress=False).run()["prompt_effect"]
    assert prompted["applicable"] and prompted["images"] > 0
    assert prompted["changed"] > 0 and prompted["feature_shift"] > 0
    head_only = Experiment(tiny_config(method={"length": 0}), tmp_path / "h", show_progress=False).run()
    assert head_only["prompt_effect"] == {"applicable": False}
    assert "prompt_effect" not in [c["name"] for c in head_only["validity"]["checks"]]


def test_learning_checks_on_hand_made_logs() -> None:
    rounds = [
        {"task": 0, "round": 0, "last_loss": 2.0, "chance_loss": math.log(10)},
        {"task": 0, "round": 1, "last_loss": 0.9, "chance_loss": math.log(10)},  # the task's last round counts
        {"task": 1, "round": 0, "last_loss": 1.0, "chance_loss": math.log(10)},
    ]
    assert check_client_loss(rounds).passed
    rounds[-1]["last_loss"] = 1.3  # 1.3 / ln 10 = 0.56 > 0.5
    assert not check_client_loss(rounds).passed
    assert check_learned_tasks([LearnedTask(0, 30.0, 200, 10.0), LearnedTask(1, 22.0, 200, 10.0)]).passed
    assert not check_learned_tasks([LearnedTask(0, 30.0, 200, 10.0), LearnedTask(1, 12.0, 200, 10.0)]).passed


def logged(*rounds: dict) -> RunEvidence:
    return RunEvidence(rounds=list(rounds))


def test_method_signals_fail_at_chance_and_pass_when_active() -> None:
    at_chance = logged({"diag/local_key_hit": 13.0, "diag/local_key_chance": 12.5})
    assert not check_key_hit(at_chance).passed
    assert check_key_hit(logged({"diag/local_key_hit": 40.0, "diag/local_key_chance": 12.5})).passed
    assert check_lcdc(logged({"lcdc_nll_after": 50.0, "lcdc_nll_unprompted": 60.0})).passed
    assert not check_lcdc(logged({"lcdc_nll_after": 61.0, "lcdc_nll_unprompted": 60.0})).passed
    moved = {"stage_a_vs_fedavg": 0.3, "stage_a_loss_first": 2.0, "stage_a_loss_last": 1.0}
    assert check_stage_a(logged(moved)).passed
    assert not check_stage_a(logged({**moved, "stage_a_vs_fedavg": 0.001})).passed
    assert not check_stage_a(logged({**moved, "stage_a_loss_last": 2.5})).passed
    assert check_key_hit(logged({"loss": 1.0})) is None  # a method that does not report the signal is not held to it


def test_methods_declare_their_signals_and_the_gate_applies_only_the_declared_ones() -> None:
    assert check_key_hit in METHODS.get("fedmgp").signals
    assert {check_generator_fidelity, check_stage_a} <= set(METHODS.get("hepco").signals)
    assert check_lcdc in METHODS.get("c2prompt").signals
    cfg = {"backbone": {"weights": "w.safetensors"}}
    run = RunEvidence(cfg, [{"task": 0, "round": 0, "diag/local_key_hit": 13.0, "diag/local_key_chance": 12.5}])
    assert gate(run)["valid"]  # no signal declared: the key hit is not read
    assert failed_checks(gate(run, METHODS.get("fedmgp").signals)) == ["key_hit"]


def test_gate_is_valid_only_when_every_applicable_check_passes() -> None:
    cfg = {"backbone": {"weights": "w.safetensors"}}
    rounds = [{"task": 0, "round": 0, "last_loss": 0.5, "chance_loss": math.log(10)}]
    learned = [LearnedTask(0, 40.0, 100, 10.0)]
    effect = {"applicable": True, "changed": 20.0, "accuracy": 40.0, "accuracy_off": 30.0, "feature_shift": 0.1}
    assert gate(RunEvidence(cfg, rounds, learned, effect))["valid"]
    assert not gate(RunEvidence(cfg, rounds, learned, {**effect, "changed": 1.0}))["valid"]
    assert failed_checks(gate(RunEvidence({"backbone": {}}, rounds, learned, effect))) == ["backbone_pretrained"]
    assert failed_checks(None) == ["no validity record"]


def test_generator_fidelity_is_read_as_the_fraction_hepco_logs() -> None:
    assert not check_generator_fidelity(logged({"generator_fidelity": 0.15}, {"generator_fidelity": 0.5})).passed
    assert check_generator_fidelity(logged({"generator_fidelity": 0.9}, {"generator_fidelity": 0.7})).passed
