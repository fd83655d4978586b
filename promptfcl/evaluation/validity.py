"""The validity gate: does a finished run carry the evidence that it learned, and that its mechanism was active?

A comparison between methods only counts when each run demonstrably learned and the component under test did its
job. Every run's `metrics.json` gets a `validity` block, `{"valid": bool, "checks": [...]}`, each check
`{name, value, threshold, passed, detail, verdict}`; studies flag cells with a failing seed and claims built on
them are `invalid` (`promptfcl.claims`). The generic checks, and why each threshold:

- `backbone_pretrained`: the frozen backbone loaded weights (a random-init backbone tests mechanics, not methods).
- `client_loss`: at the last round of every task, the clients' mean final-epoch training loss is at most
  `LOSS_FRACTION` × their mean *label-prior loss* (`prior_loss`: the entropy of each client's own labels in the
  task, the loss of always predicting its label frequencies). A model that learned only each client's label prior
  scores a ratio of 1; ln K would let it pass under label skew (at Dirichlet β = 0.05 a client's label entropy is
  0.3–0.6 · ln 10). Tasks whose clients each hold a single class have nothing to learn locally and are skipped.
  The final epoch's mean, not one batch, so a 1-image tail batch cannot decide it.
- `learned_tasks`: every task's accuracy right after it is learned is above chance (chance = 1 / the classes that
  compete for its test images) with a one-sided binomial p below `CHANCE_P`, *and* at least `LEARN_FLOOR` × chance
  (capped halfway from chance to 100 %, so that a two-class task can reach it; `learn_floor`). The floor is what
  "learned" means: with 200 test images a 10-class task at 17.5 % is significantly above 10 %, yet four of five of
  its predictions are wrong; twice chance is the least a model that tells the task's classes apart should reach.
  A task whose readout has a single class (chance 100 %) has nothing to tell apart and is skipped. A non-finite
  loss or parameter move (a diverged run) fails its check.
- `parameters_moved`: every group of trained tensors the server holds (`prompt`, `head`, `adapter`, … — the
  `move/<group>` the loop logs each round, ‖Δw‖ / ‖w‖ over the round), and every group the clients keep to
  themselves (reported in their replies, `mean_reply_moves`), moved at least `MIN_MOVE` in total over the run: a
  component that never left its initial value was not trained, whatever its output.
- `prompt_benefit`: the final model(s) run again inside `FrozenViT.prompts_disabled()` (prompts and adapters
  gone, exactly the frozen forward) on the same test images; McNemar's exact test of the images right only with
  them (`gained`) against those right only without (`lost`) classifies them as helps / neutral / hurts
  (`evaluation.prompt_effect.mcnemar`). Prompts that significantly *hurt* fail; neutral ones pass the gate but are
  recorded (a claim needs its mechanism to help: `promptfcl.claims`). Not applicable to head-only models.
- method signals: each method declares its own checks (`register_method(signals=...)`, kept in its folder), at
  least one for its defining mechanism, which must fail when that mechanism is switched off. Each reads the run's
  evidence (`RunEvidence`: config, round log, tasks learned, prompt effect, component ablations) and returns a
  `Check`, or None when it does not apply. The builders below serve the common cases: `switch_on` (the defining
  switch is on), `prompt_mechanism` (for methods whose mechanism is the prompt) and `component_mechanism` (a
  server-side component: the regime compares the final model with the server's `ablations()`). A mechanism check
  fails when the component is off, changes under `MIN_ACTIVE` % of the test predictions (inert: a measurable effect
  is what "active" means) or significantly hurts; its helps / neutral / hurts verdict is recorded, and a claim needs
  `helps` (pooled over its seeds) to be reproduced — being active is evidence the run is what it says it is, helping
  is evidence for the paper's claim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from promptfcl.evaluation.prompt_effect import BENEFIT_P

LOSS_FRACTION = 0.5
CHANCE_P = 1e-3
LEARN_FLOOR = 2.0  # × chance
MIN_MOVE = 1e-3  # summed relative move of a tensor group over the run
MIN_ACTIVE = 1.0  # % of test predictions a mechanism must change to count as active
LEARNING_CHECKS = ("client_loss", "learned_tasks")
"""The checks that a run learned its tasks (`check_client_loss`, `check_learned_tasks`), as opposed to checks that
it ran as intended or that its mechanism acted."""


@dataclass
class Check:
    """One piece of evidence: its value, the threshold it is held to, whether it passed, and for a component's
    paired test its verdict (helps / neutral / hurts)."""

    name: str
    value: float | None
    threshold: str
    passed: bool
    detail: str = ""
    verdict: str | None = None


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


@dataclass
class RunEvidence:
    """What a finished run offers the gate: its config (as JSON), its round log, each task's accuracy right after
    it was learned, the prompt-effect measurement of its final model(s) and the server's component ablations
    (`{name: the same measurement with that component taken out}`)."""

    config: dict[str, Any] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    learned: list[LearnedTask] = field(default_factory=list)
    prompt_effect: dict[str, Any] | None = None
    ablations: dict[str, dict[str, Any]] = field(default_factory=dict)

    def method(self) -> dict[str, Any]:
        """The run's method section."""
        return dict(self.config.get("method") or {})


Signal = Callable[[RunEvidence], Check | None]


def check_backbone(cfg: dict[str, Any]) -> Check:
    """The frozen backbone loaded pretrained weights."""
    b = cfg.get("backbone", {})
    ok = bool(b.get("weights")) or bool(b.get("pretrained"))
    return Check("backbone_pretrained", float(ok), "weights loaded", ok, "" if ok else "random-init backbone")


def check_client_loss(rounds: list[dict[str, Any]]) -> Check | None:
    """Final-epoch client loss against the clients' label-prior loss at the last round of every task that logged
    both (a non-finite loss, e.g. a diverged run, fails)."""
    last: dict[int, dict[str, Any]] = {}
    for r in rounds:
        if r.get("last_loss") is not None and r.get("prior_loss") is not None:
            last[r["task"]] = r
    pairs = [(float(r["last_loss"]), float(r["prior_loss"])) for r in last.values()]
    pairs = [(a, b) for a, b in pairs if not (math.isfinite(b) and b <= 1e-9)]  # single-class clients: nothing to learn
    if not pairs:
        return None
    ratios = [a / b if math.isfinite(a) and math.isfinite(b) else math.nan for a, b in pairs]
    worst = math.nan if any(math.isnan(x) for x in ratios) else max(ratios)
    return Check(
        "client_loss",
        worst,
        f"≤ {LOSS_FRACTION} (final-epoch loss / label-prior loss, worst task)",
        math.isfinite(worst) and worst <= LOSS_FRACTION,
        ", ".join(f"{a:.2f}/{b:.2f}" for a, b in pairs),
    )


def learn_floor(chance: float) -> float:
    """The accuracy (percent) that means "learned" at `chance` percent: `LEARN_FLOOR` × chance, capped halfway from
    chance to 100 % so that a task with chance ≥ 50 % (two classes) can reach it."""
    return min(LEARN_FLOOR * chance, (100.0 + chance) / 2.0)


def check_learned_tasks(tasks: list[LearnedTask]) -> Check | None:
    """Every task right after it was learned: significantly above chance and at least its `learn_floor` (tasks with
    a single competing class, chance 100 %, have nothing to tell apart and are skipped)."""
    tasks = [t for t in tasks if t.chance < 100.0]
    if not tasks:
        return None
    ps = [
        binomial_tail(round(t.accuracy / 100.0 * t.total), t.total, t.chance / 100.0) if t.accuracy > t.chance else 1.0
        for t in tasks
    ]
    worst = max(ps)
    floor_ok = all(t.accuracy >= learn_floor(t.chance) for t in tasks)
    detail = [f"{t.accuracy:.1f}/{t.chance:.1f}" for t in tasks]
    return Check(
        "learned_tasks",
        worst,
        f"binomial p < {CHANCE_P:g} and accuracy ≥ min({LEARN_FLOOR:g} × chance, (100 + chance) / 2) for every task "
        "(right after it)",
        worst < CHANCE_P and floor_ok,
        ", ".join(detail),
    )


def parameter_moves(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """How far each group of trained tensors moved in a round, relative to its size: `move/<group>` =
    ‖w_after − w_before‖ / max(‖w_before‖, ‖w_after‖) over the group's tensors (a group is a name's first part:
    `prompt`, `head`, `adapter`, …; a `client3/`-style owner prefix is dropped). The validity gate sums them over
    the run (`parameters_moved`): a group that never left its value was not trained. The experiment loop applies it
    to what the server holds; a client program applies it to the state it keeps to itself (`mean_reply_moves`)."""
    sums: dict[str, list[float]] = {}
    for name, a in after.items():
        b = before.get(name)
        if b is None or b.shape != a.shape:
            continue
        group = name.rsplit("/", 1)[-1].split(".", 1)[0]
        s = sums.setdefault(group, [0.0, 0.0, 0.0])
        s[0] += float((a.double() - b.double()).pow(2).sum())
        s[1] += float(b.double().pow(2).sum())
        s[2] += float(a.double().pow(2).sum())
    return {f"move/{g}": (d**0.5) / max(nb**0.5, na**0.5, 1e-12) for g, (d, nb, na) in sorted(sums.items())}


def mean_reply_moves(scalars: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The mean over replies of their `move/<group>` scalars: how far the trained state that clients keep to
    themselves (personal heads, local prompts), which the server never sees, moved in their round's training. A
    round server returns it among its round metrics (`RoundServer.run_round`), beside the moves the loop measures on
    what the server holds."""
    sums: dict[str, list[float]] = {}
    for s in scalars:
        for k, v in s.items():
            if k.startswith("move/") and isinstance(v, int | float):
                sums.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def check_parameters_moved(rounds: list[dict[str, Any]]) -> Check | None:
    """Every trained tensor group moved over the run (summed per-round relative moves); a group with a non-finite
    move (diverged) fails."""
    totals: dict[str, float] = {}
    for r in rounds:
        for k, v in r.items():
            if k.startswith("move/") and isinstance(v, int | float):
                group = k[len("move/") :]
                totals[group] = totals.get(group, 0.0) + (float(v) if math.isfinite(v) else math.nan)
    if not totals:
        return None
    diverged = [g for g, v in totals.items() if not math.isfinite(v)]
    least = diverged[0] if diverged else min(totals, key=totals.__getitem__)
    return Check(
        "parameters_moved",
        totals[least],
        f"≥ {MIN_MOVE:g} for every trained group (Σ_rounds ‖Δw‖ / ‖w‖, least-moved group)",
        not diverged and totals[least] >= MIN_MOVE,
        ", ".join(f"{g} {v:.3g}" for g, v in sorted(totals.items())),
    )


def effect_detail(effect: dict[str, Any]) -> str:
    """A with / without measurement in words: both accuracies, the McNemar counts and p, the share changed."""
    on, off = effect.get("accuracy", float("nan")), effect.get("accuracy_off", float("nan"))
    out = f"accuracy {on:.1f} with, {off:.1f} without; right only with {effect.get('gained')}, only without "
    out += f"{effect.get('lost')} (McNemar p {effect.get('mcnemar_p', float('nan')):.2g}); "
    out += f"{effect.get('changed', float('nan')):.1f} % of predictions change"
    if effect.get("feature_shift") is not None:
        out += f"; mean 1 − cos {effect['feature_shift']:.3f}"
    return out


def check_prompt_benefit(effect: dict[str, Any] | None) -> Check | None:
    if not effect or not effect.get("applicable", True) or effect.get("verdict") is None:
        return None
    gain = effect.get("accuracy", float("nan")) - effect.get("accuracy_off", float("nan"))
    return Check(
        "prompt_benefit", gain, f"not hurts (McNemar, p < {BENEFIT_P:g}): accuracy with − without the prompts, points",
        effect["verdict"] != "hurts", effect_detail(effect), effect["verdict"],
    )  # fmt: skip


def series(rounds: list[dict[str, Any]], key: str) -> list[float]:
    """The finite values of `key` over the round log."""
    return [float(r[key]) for r in rounds if isinstance(r.get(key), int | float) and math.isfinite(r[key])]


def mean(v: list[float]) -> float:
    """The mean of a non-empty series (NaN for an empty one)."""
    return sum(v) / len(v) if v else math.nan


# ------------------------------------------------------------------------------- builders for method signals
def switch_on(name: str, key: str, what: str) -> Signal:
    """A signal that fails when the method's defining switch `method.<key>` is off (false, 0 or "none")."""

    def check(run: RunEvidence) -> Check:
        value = run.method().get(key)
        on = bool(value) and value != "none"
        return Check(name, float(on), f"method.{key} on", on, f"{what}: method.{key} = {value!r}")

    check.__name__ = f"switch_{key}"
    return check


def mechanism_check(name: str, effect: dict[str, Any] | None, what: str) -> Check:
    """A component's mechanism check from its with / without measurement: it fails when the component was not
    measured (off), changed under `MIN_ACTIVE` % of the predictions (inert) or significantly hurts; its McNemar
    verdict is recorded (claims need `helps`, pooled over seeds: `promptfcl.claims`)."""
    if not effect or not effect.get("applicable", True) or effect.get("verdict") is None:
        return Check(name, None, f"{what} measured", False, f"no with / without measurement: {what} is off")
    changed, verdict = float(effect.get("changed") or 0.0), effect["verdict"]
    ok = changed >= MIN_ACTIVE and verdict != "hurts"
    threshold = f"≥ {MIN_ACTIVE:g} % of predictions changed and not hurts (McNemar, p < {BENEFIT_P:g})"
    return Check(name, changed, threshold, ok, effect_detail(effect), verdict)


def prompt_mechanism(run: RunEvidence) -> Check:
    """The prompts (the method's defining mechanism) are active in its own run and do not hurt."""
    return mechanism_check("prompt_mechanism", run.prompt_effect, "the prompts")


def component_mechanism(component: str, what: str) -> Signal:
    """A signal that the server-side component `component` (an entry of the server's `ablations()`) is active and
    does not hurt: the final model against itself without that component; absent when the component is off."""

    def check(run: RunEvidence) -> Check:
        return mechanism_check(f"{component}_mechanism", run.ablations.get(component), what)

    check.__name__ = f"{component}_mechanism"
    return check


def gate(run: RunEvidence, signals: Sequence[Signal] = ()) -> dict[str, Any]:
    """The run's `validity` block: the generic checks and the method's own `signals` (declared with
    `register_method(signals=...)`), every applicable one; valid when all pass."""
    found = [
        check_backbone(run.config),
        check_client_loss(run.rounds),
        check_learned_tasks(run.learned),
        check_parameters_moved(run.rounds),
        check_prompt_benefit(run.prompt_effect),
        *(signal(run) for signal in signals),
    ]
    checks = [c for c in found if c is not None]
    return {"valid": all(c.passed for c in checks), "checks": [asdict(c) for c in checks]}


def failed_checks(validity: dict[str, Any] | None) -> list[str]:
    """Names of the failed checks of a run's validity block ([] when valid; ["no validity record"] if absent)."""
    if not validity:
        return ["no validity record"]
    return [c["name"] for c in validity.get("checks", []) if not c["passed"]]
