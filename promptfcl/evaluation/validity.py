"""The validity gate: does a finished run carry the evidence that it trained and that its mechanism was active?

A comparison between methods only counts when each run demonstrably learned and the component under test did
something. Every run's `metrics.json` gets a `validity` block, `{"valid": bool, "checks": [...]}`, each check
`{name, value, threshold, passed, detail}`; studies flag cells with a failing seed and claims built on them are
`invalid` (`promptfcl.claims`). The checks, and why each threshold:

- `backbone_pretrained`: the frozen backbone loaded weights (a random-init backbone tests mechanics, not methods).
- `client_loss`: at the last round of every task, the clients' mean final-epoch training loss is at most
  `LOSS_FRACTION` × ln K, K the logits that compete in their CE (ln K is the loss of a uniform guess). The
  final epoch's mean, not one batch, so a 1-image tail batch cannot decide it.
- `learned_tasks`: every task's accuracy right after it is learned is above chance (chance = 1 / the classes that
  compete for its test images: the task's classes task-aware, else the task's classes too — a model that only
  knows "the newest task" scores that) with a one-sided binomial p below `CHANCE_P`.
- `prompt_effect`: removing every prompt (and adapter) from the final model — `FrozenViT.prompts_disabled()`,
  which yields the frozen prompt-free forward exactly — changes at least `MIN_CHANGED` % of its test predictions.
  Also reported: accuracy with and without prompts and the mean 1 − cos between prompted and prompt-free features.
  Not applicable to head-only models (no prompt parameters).
- method signals: each method declares its own checks (`register_method(signals=...)`, kept in the method's
  folder); each reads the run's evidence (usually series from the round log, `series`) and returns a `Check`,
  or None when the run carries no such evidence (a method that does not log a signal is not held to it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

LOSS_FRACTION = 0.5
CHANCE_P = 1e-3
MIN_CHANGED = 5.0


@dataclass
class Check:
    """One piece of evidence: its value, the threshold it is held to, and whether it passed."""

    name: str
    value: float | None
    threshold: str
    passed: bool
    detail: str = ""


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X ≥ k) for X ~ Binomial(n, p), exact (log-space sum)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    logs = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p) + (n - i) * math.log1p(-p)
        for i in range(k, n + 1)
    ]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


@dataclass
class LearnedTask:
    """A task's accuracy right after it was learned, its test-set size and the chance accuracy of its readout."""

    task: int
    accuracy: float
    total: int
    chance: float  # percent


def check_backbone(cfg: dict[str, Any]) -> Check:
    b = cfg.get("backbone", {})
    ok = bool(b.get("weights")) or bool(b.get("pretrained"))
    return Check("backbone_pretrained", float(ok), "weights loaded", ok, "" if ok else "random-init backbone")


def check_client_loss(rounds: list[dict[str, Any]]) -> Check | None:
    """Final-epoch client loss against ln K at the last round of every task."""
    last: dict[int, dict[str, Any]] = {}
    for r in rounds:
        last[r["task"]] = r
    pairs = [(r["last_loss"], r["chance_loss"]) for r in last.values() if r.get("last_loss") is not None]
    pairs = [(a, b) for a, b in pairs if b and b > 0]
    if not pairs:
        return None
    worst = max(a / b for a, b in pairs)
    return Check(
        "client_loss",
        worst,
        f"≤ {LOSS_FRACTION} (final-epoch loss / ln K, worst task)",
        worst <= LOSS_FRACTION,
        ", ".join(f"{a:.2f}/{b:.2f}" for a, b in pairs),
    )


def check_learned_tasks(tasks: list[LearnedTask]) -> Check | None:
    if not tasks:
        return None
    ps = [
        binomial_tail(round(t.accuracy / 100.0 * t.total), t.total, t.chance / 100.0) if t.accuracy > t.chance else 1.0
        for t in tasks
    ]
    worst = max(ps)
    detail = [f"{t.accuracy:.1f}/{t.chance:.1f}" for t in tasks]
    return Check(
        "learned_tasks",
        worst,
        f"binomial p < {CHANCE_P:g} for every task (accuracy right after it / chance)",
        worst < CHANCE_P,
        ", ".join(detail),
    )


def check_prompt_effect(effect: dict[str, Any] | None) -> Check | None:
    if not effect or not effect.get("applicable", True):
        return None
    changed = effect.get("changed")
    if changed is None:
        return None
    on, off = effect.get("accuracy", float("nan")), effect.get("accuracy_off", float("nan"))
    detail = f"accuracy {on:.1f} with prompts, {off:.1f} without"
    if effect.get("feature_shift") is not None:
        detail += f"; mean 1 − cos {effect['feature_shift']:.3f}"
    return Check("prompt_effect", changed, f"≥ {MIN_CHANGED:g} % predictions changed", changed >= MIN_CHANGED, detail)


def series(rounds: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rounds if isinstance(r.get(key), int | float) and math.isfinite(r[key])]


def mean(v: list[float]) -> float:
    return sum(v) / len(v)


@dataclass
class RunEvidence:
    """What a finished run offers the gate: its config (as JSON), its round log, each task's accuracy right after
    it was learned, and the prompt-effect measurement of its final model(s)."""

    config: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    learned: list[LearnedTask] = field(default_factory=list)
    prompt_effect: dict[str, Any] | None = None


Signal = Callable[[RunEvidence], Check | None]


def gate(run: RunEvidence, signals: Sequence[Signal] = ()) -> dict[str, Any]:
    """The run's `validity` block: the generic checks and the method's own `signals` (declared with
    `register_method(signals=...)`), every applicable one; valid when all pass."""
    found = [
        check_backbone(run.config),
        check_client_loss(run.rounds),
        check_learned_tasks(run.learned),
        check_prompt_effect(run.prompt_effect),
        *(signal(run) for signal in signals),
    ]
    checks = [c for c in found if c is not None]
    return {"valid": all(c.passed for c in checks), "checks": [asdict(c) for c in checks]}


def failed_checks(validity: dict[str, Any] | None) -> list[str]:
    """Names of the failed checks of a run's validity block ([] when valid; ["no validity record"] if absent)."""
    if not validity:
        return ["no validity record"]
    return [c["name"] for c in validity.get("checks", []) if not c["passed"]]
