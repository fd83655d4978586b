"""The validity gate (v2): a run that did not learn is flagged (loss against the clients' label prior, a floor above
chance, parameters that moved), the prompts' benefit is classified by McNemar's test, and every method family's
defining mechanism, switched off, fails its own declared check."""

from __future__ import annotations

import math

import pytest
import torch

from promptfcl.config import build_config
from promptfcl.evaluation.prompt_effect import mcnemar
from promptfcl.evaluation.validity import (
    LearnedTask,
    RunEvidence,
    binomial_tail,
    check_client_loss,
    check_learned_tasks,
    check_parameters_moved,
    check_prompt_benefit,
    failed_checks,
    gate,
    prompt_mechanism,
)
from promptfcl.experiment import Experiment, parameter_moves
from promptfcl.methods import METHODS
from promptfcl.methods.c2prompt.signals import check_lcdc
from promptfcl.methods.fedmgp.signals import check_key_hit
from promptfcl.methods.hepco.signals import check_generator_fidelity, check_stage_a
from promptfcl.training.local import prior_loss

from .conftest import deep_update, tiny_config, tiny_raw


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
    assert {"client_loss", "learned_tasks", "parameters_moved"} <= set(failed_checks(frozen))
    for name in ("client_loss", "learned_tasks", "parameters_moved"):
        assert name not in failed_checks(trained), name
    assert "backbone_pretrained" in failed_checks(trained)  # the tiny test ViT is random-init: never valid evidence


@pytest.mark.slow
def test_prompt_effect_is_measured_on_prompted_models_and_not_applicable_to_head_only(tmp_path) -> None:
    prompted = Experiment(tiny_config(), tmp_path / "p", show_progress=False).run()["prompt_effect"]
    assert prompted["applicable"] and prompted["images"] > 0
    assert prompted["changed"] > 0 and prompted["feature_shift"] > 0
    assert prompted["gained"] - prompted["lost"] == round((prompted["accuracy"] - prompted["accuracy_off"])
                                                          * prompted["images"] / 100)  # fmt: skip
    assert prompted["verdict"] in ("helps", "neutral", "hurts")
    head_only = Experiment(tiny_config(method={"length": 0}), tmp_path / "h", show_progress=False).run()
    assert head_only["prompt_effect"] == {"applicable": False}
    assert "prompt_benefit" not in [c["name"] for c in head_only["validity"]["checks"]]


def test_label_prior_loss_is_the_entropy_of_the_clients_labels() -> None:
    assert prior_loss(torch.tensor([3, 3, 3, 3])) == 0.0
    assert prior_loss(torch.tensor([0, 1, 0, 1])) == pytest.approx(math.log(2))
    assert prior_loss(torch.tensor([5, 5, 5, 7])) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


def test_client_loss_is_held_to_the_label_prior_not_to_ln_k() -> None:
    """Under label skew a model that learned only each client's label prior has a loss far below ln K: it passes a
    ln K rule but scores a ratio of 1 here."""
    prior = 0.4 * math.log(10)  # a β = 0.05 client: its labels carry 0.4 · ln 10 nats
    rounds = [
        {"task": 0, "round": 0, "last_loss": 2.0, "chance_loss": math.log(10), "prior_loss": prior},
        {"task": 0, "round": 1, "last_loss": 0.4 * prior, "chance_loss": math.log(10), "prior_loss": prior},
        {"task": 1, "round": 0, "last_loss": 0.3 * prior, "chance_loss": math.log(10), "prior_loss": prior},
    ]
    assert check_client_loss(rounds).passed
    rounds[-1]["last_loss"] = prior  # the prior's own loss: 0.92 / ln 10 = 0.4 would pass a ln K rule
    assert not check_client_loss(rounds).passed
    single = [{"task": 0, "round": 0, "last_loss": 0.0, "chance_loss": math.log(10), "prior_loss": 0.0}]
    assert check_client_loss(single) is None  # every client holds one class: nothing to learn locally
    for order in (0, 1):  # a diverged task fails wherever it sits in the log (max() alone ignores a trailing NaN)
        diverged = [dict(rounds[0]), {"task": 1, "round": 0, "last_loss": math.nan, "prior_loss": prior}]
        diverged[0]["last_loss"] = 0.1 * prior
        assert not check_client_loss(diverged[:: 1 - 2 * order]).passed
    no_loss = [*rounds[:2], {"task": 0, "round": 2, "prior_loss": prior}]  # a server-only round logs no loss
    assert check_client_loss(no_loss).value == pytest.approx(0.4)  # the task's last round *with* a loss decides


def test_learned_tasks_needs_significance_and_twice_chance() -> None:
    assert check_learned_tasks([LearnedTask(0, 30.0, 200, 10.0), LearnedTask(1, 22.0, 200, 10.0)]).passed
    assert not check_learned_tasks([LearnedTask(0, 30.0, 200, 10.0), LearnedTask(1, 12.0, 200, 10.0)]).passed
    low = LearnedTask(1, 17.5, 200, 10.0)  # binomial p ≈ 6e-4 < 1e-3, yet four predictions in five are wrong
    assert binomial_tail(35, 200, 0.1) < 1e-3
    assert not check_learned_tasks([LearnedTask(0, 30.0, 200, 10.0), low]).passed
    binary = LearnedTask(0, 90.0, 200, 50.0)  # two classes: 2 × chance would ask for 100 %; the cap asks for 75 %
    assert check_learned_tasks([binary]).passed
    assert not check_learned_tasks([LearnedTask(0, 70.0, 200, 50.0)]).passed
    assert check_learned_tasks([LearnedTask(0, 100.0, 200, 100.0)]) is None  # one class: nothing to tell apart


def test_parameters_moved_sums_relative_moves_per_group() -> None:
    before = {"prompt.p": torch.ones(4), "head.weight": torch.ones(2, 2), "prompt.n": torch.zeros(0)}
    after = {"prompt.p": torch.tensor([1.0, 1.0, 1.0, 3.0]), "head.weight": torch.ones(2, 2)}
    moves = parameter_moves(before, after)
    assert moves["move/prompt"] == pytest.approx(2.0 / math.sqrt(12))  # ‖Δ‖ = 2, max(‖before‖, ‖after‖) = √12
    assert moves["move/head"] == 0.0
    assert parameter_moves({"task3/prompt.p": torch.ones(2)}, {"task3/prompt.p": torch.ones(2)}) == {"move/prompt": 0.0}
    rounds = [{"move/prompt": 0.3, "move/head": 0.0}, {"move/prompt": 0.2, "move/head": 0.0}]
    check = check_parameters_moved(rounds)
    assert not check.passed and "head 0" in check.detail  # a head left at its init is inert
    rounds[1]["move/head"] = 0.01
    assert check_parameters_moved(rounds).passed
    rounds.append({"move/prompt": math.nan, "move/head": 0.01})  # the prompt diverged: it fails, it is not dropped
    check = check_parameters_moved(rounds)
    assert not check.passed and "prompt nan" in check.detail


def test_mcnemar_classifies_a_component_as_helps_neutral_or_hurts() -> None:
    p, verdict = mcnemar(10, 0)
    assert p == pytest.approx(2 * 0.5**10) and verdict == "helps"
    assert mcnemar(5, 5)[1] == "neutral" and mcnemar(9, 3)[1] == "neutral"  # p = 0.146
    assert mcnemar(1, 12)[1] == "hurts"
    assert mcnemar(0, 0) == (1.0, "neutral")
    from scipy.stats import binomtest

    assert mcnemar(30, 14)[0] == pytest.approx(binomtest(30, 44, 0.5).pvalue)


def effect(gained: int, lost: int, total: int = 1000, on: float = 40.0) -> dict:
    p, verdict = mcnemar(gained, lost)
    off = on - 100 * (gained - lost) / total
    return {"applicable": True, "images": total, "changed": 10.0, "accuracy": on, "accuracy_off": off,
            "gained": gained, "lost": lost, "mcnemar_p": p, "verdict": verdict}  # fmt: skip


def test_prompts_that_hurt_fail_the_gate_and_a_mechanism_must_be_active() -> None:
    assert check_prompt_benefit(effect(80, 20)).passed
    assert check_prompt_benefit(effect(40, 38)).passed  # neutral: recorded, not a failure of the generic gate
    assert check_prompt_benefit(effect(20, 80)).verdict == "hurts"
    assert not check_prompt_benefit(effect(20, 80)).passed
    assert prompt_mechanism(RunEvidence(prompt_effect=effect(80, 20))).passed
    neutral = prompt_mechanism(RunEvidence(prompt_effect=effect(40, 38)))
    assert neutral.passed and neutral.verdict == "neutral"  # active, no significant benefit: recorded for claims
    assert not prompt_mechanism(RunEvidence(prompt_effect={**effect(3, 2), "changed": 0.5})).passed  # inert
    assert not prompt_mechanism(RunEvidence(prompt_effect=effect(20, 80))).passed  # hurts
    assert not prompt_mechanism(RunEvidence(prompt_effect=None)).passed  # off


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
    cfg = {"backbone": {"weights": "w.safetensors"}, "method": {"local_prompt": True}}
    run = RunEvidence(cfg, [{"task": 0, "round": 0, "diag/local_key_hit": 13.0, "diag/local_key_chance": 12.5}])
    assert gate(run)["valid"]  # no signal declared: the key hit is not read
    assert failed_checks(gate(run, METHODS.get("fedmgp").signals)) == ["key_hit"]
    run.config["method"] = {"local_prompt": False}
    assert "local_prompts_on" in failed_checks(gate(run, METHODS.get("fedmgp").signals))


def test_gate_is_valid_only_when_every_applicable_check_passes() -> None:
    cfg = {"backbone": {"weights": "w.safetensors"}}
    rounds = [{"task": 0, "round": 0, "last_loss": 0.5, "chance_loss": math.log(10), "prior_loss": 1.5}]
    learned = [LearnedTask(0, 40.0, 100, 10.0)]
    good = effect(120, 20)
    assert gate(RunEvidence(cfg, rounds, learned, good))["valid"]
    assert not gate(RunEvidence(cfg, rounds, learned, effect(20, 120)))["valid"]
    assert failed_checks(gate(RunEvidence({"backbone": {}}, rounds, learned, good))) == ["backbone_pretrained"]
    assert failed_checks(None) == ["no validity record"]


def test_generator_fidelity_is_read_as_the_fraction_hepco_logs() -> None:
    assert not check_generator_fidelity(logged({"generator_fidelity": 0.15}, {"generator_fidelity": 0.5})).passed
    assert check_generator_fidelity(logged({"generator_fidelity": 0.9}, {"generator_fidelity": 0.7})).passed


HGP = {"name": "hgp", "length": 4, "layers": [0, 1], "local_epochs": 2, "batch_size": 8, "lr": 0.01}
HEPCO = {
    "name": "hepco", "augment": "flip", "pool_size": 8, "length": 4, "layers": [0, 1], "local_epochs": 1,
    "batch_size": 8, "lr": 0.01, "generator_iterations": 5, "kd_iterations": 5,
}  # fmt: skip
ASYNC = {
    "data": {"options": {"num_classes": 12, "train_per_class": 24, "test_per_class": 6}},
    "scenario": {"kind": "asynchronous", "num_tasks": 2, "num_clients": 3, "classes_per_task": 4, "rounds_per_task": 2,
                 "asynchronous": {"data_slices": 2}},
}  # fmt: skip
C2P = {"name": "c2prompt", "components_per_stage": 2, "layers": [0, 1], "local_epochs": 1, "batch_size": 8,
       "lr": 0.01, "length": 2}  # fmt: skip
FEDMGP = {
    "name": "fedmgp", "pool_size": 4, "length": 2, "top_k": 2, "local_layers": [1], "local_length": 2,
    "head_hidden": 16, "local_epochs": 1, "batch_size": 8, "lr": 0.01, "proxy_per_class": 4, "fusion_epochs": 2,
}  # fmt: skip
PERSONAL = {
    "scenario": {
        "kind": "personalized", "num_tasks": 2, "num_clients": 3, "rounds_per_task": 2, "class_order": "shuffled",
        "partition": {"min_samples": 0}, "personalized": {"private_classes": 1, "public_classes": 3},
    },
    "eval": {"regime": "client_local", "batch_size": 32},
}  # fmt: skip
LORM = {"name": "lorm", "rank": 2, "layers": [0, 1], "local_epochs": 1, "batch_size": 8, "lr": 0.003}
PILORA = {"name": "pilora", "rank": 2, "layers": [0], "local_epochs": 1, "batch_size": 8, "lr": 1e-3, "proto_lr": 0.05}
SWITCHED_OFF = {  # a method family's defining mechanism switched off (or left at its init) → the checks it must fail
    "hgp without rebalancing": (tiny_raw(method={**HGP, "rebalance": "none"}),
                                {"rebalancing_on", "rebalancing_mechanism"}),
    "hepco without distillation": (tiny_raw(method={**HEPCO, "server_kd": False}),
                                   {"distillation_on", "distillation_mechanism"}),
    "c2prompt without lcdc": (deep_update(tiny_raw(), {**ASYNC, "method": {**C2P, "lcdc": False}}), {"lcdc_on"}),
    "fedmgp without local prompts": ({**deep_update(tiny_raw(), PERSONAL), "method": {**FEDMGP, "local_prompt": False}},
                                     {"local_prompts_on"}),
    "prompts left at their init": (tiny_raw(method={"lr": 0.0}), {"parameters_moved"}),
    "lorm adapters left at their init": (tiny_raw(method={**LORM, "lr": 1e-9}), {"parameters_moved"}),  # lr > 0
    "pilora with uniform prototype weights": (tiny_raw(method={**PILORA, "reweight_temperature": 1e6}),
                                              {"reweighting"}),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SWITCHED_OFF))
def test_a_family_with_its_mechanism_switched_off_fails_its_own_check(case: str, tmp_path) -> None:
    raw, must_fail = SWITCHED_OFF[case]
    metrics = Experiment(build_config(raw), tmp_path / "run", show_progress=False).run()
    assert must_fail <= set(failed_checks(metrics["validity"])), failed_checks(metrics["validity"])


@pytest.mark.slow
def test_hgp_records_its_rebalancing_ablation_and_is_held_to_it(tmp_path) -> None:
    metrics = Experiment(tiny_config(method=HGP), tmp_path / "run", show_progress=False).run()
    ablation = metrics["ablations"]["rebalancing"]
    assert ablation["images"] > 0 and ablation["verdict"] in ("helps", "neutral", "hurts")
    assert ablation["changed"] > 0  # the FedAvg head, not the rebalanced one, is what the ablation predicts with
    checks = {c["name"]: c for c in metrics["validity"]["checks"]}
    assert checks["rebalancing_on"]["passed"]
    assert checks["rebalancing_mechanism"]["verdict"] == ablation["verdict"]
    active = ablation["changed"] >= 1.0 and ablation["verdict"] != "hurts"
    assert checks["rebalancing_mechanism"]["passed"] == active
