"""Evaluation regimes, dispatched in one place (`build_regime`) from `eval.regime` and the scenario kind.

- `ClassIncrementalRegime` (`task_agnostic` / `task_aware` over global tasks): the global model on every seen task
  after each task → the accuracy matrix, FAA, forgetting, BWT (`evaluation.metrics`). A server that scores each
  client's own model (`ServerProgram.personal_models`: the local-only control) is scored as the mean over clients
  (metrics.json `scored_model: clients`).
- `SlotRegime` (`task_aware` on an asynchronous scenario, Powder/C2Prompt): at every stage end (and every round
  with `eval.every_round`), for every (client, task) trained so far, accuracy on the test images of its real
  classes (in the owner client's image domain when `scenario.domains` is set) with logits masked to its own slots,
  using the model the server holds for that client (`ServerProgram.client_model`; `eval.model: global` forces the
  global model) → the transfer metrics of `evaluation.transfer`, FWT against `eval.direct_reference`. The tasks
  are grouped by `ServerProgram.model_key` and each model is asked for, tested and let go in turn, so a server
  may reuse one object for all of them (memory flat in clients). Which model was scored is read from the same
  keys and recorded as metrics.json `scored_model` (global | client | task), so reports can say, e.g., that
  C2Prompt is scored on each client's own CPA model and Fed-CODAP on the global one.
- `ClientLocalRegime` (`client_local` on a personalized scenario, FedMGP): every client tests its own model on its
  local test splits through `evaluate` messages sent over the run's `Grid`, with KR_t / KR_s per round
  (`evaluation.client_local`).

Every regime answers `init_state(state)`, `evaluate(server, task, rnd, last, state)` → the round's log entry,
`finish(state)` → the metrics.json entries (`summary`, `accuracy_matrix`, …), `every_round` (also evaluate after
rounds that end no task), `round_stamp(last)` (scalars stamped on the round's messages before it runs) and, for the
validity gate (`evaluation.validity`), `learned_tasks(state)` (each task's accuracy right after it was learned, its
test size and chance) — its final evaluation also measures the final model(s) with and without prompts
(`evaluation.prompt_effect`, kept in `state["prompt_effect"]`).
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from promptfcl.config import ConfigError, EvalConfig
from promptfcl.data.base import ImageSplit
from promptfcl.data.domains import ImageDomain
from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import ImageTransform
from promptfcl.evaluation.client_local import ClientLocalRegime
from promptfcl.evaluation.evaluator import Evaluator, TaskResult
from promptfcl.evaluation.metrics import accuracy_curve, class_group_accuracy, summarize
from promptfcl.evaluation.prompt_effect import PromptEffectTally, compare_ablation
from promptfcl.evaluation.transfer import stage_accuracy, transfer_summary
from promptfcl.evaluation.validity import LearnedTask
from promptfcl.federation.protocol import Grid, ServerProgram
from promptfcl.scenario.scenario import Scenario


class ServerSideRegime:
    """What the regimes that test on the server share: nothing is stamped on the round's messages; the prompt
    effect is measured on the server's final model(s)."""

    every_round = False  # also evaluate after rounds that end no task (`eval.every_round`)
    backbone: nn.Module | None = None  # the run's frozen backbone (set by `build_regime`)

    def round_stamp(self, last: bool) -> dict[str, Any]:
        return {}

    def prompt_effect_tally(self) -> PromptEffectTally | None:
        """A tally of the final model(s)' prompt effect (state["prompt_effect"]), or None when the backbone cannot
        drop prompts."""
        if self.backbone is None or not hasattr(self.backbone, "prompts_disabled"):
            return None
        return PromptEffectTally(self.backbone)


class ClassIncrementalRegime(ServerSideRegime):
    """The accuracy matrix of the global model over global tasks (class-incremental and static long-tailed runs),
    with overall / head / mid / tail accuracy when the scenario defines class groups."""

    name = "class_incremental"

    def __init__(
        self, evaluator: Evaluator, class_groups: dict[str, list[int]] | None = None, every_round: bool = False
    ) -> None:
        self.evaluator = evaluator
        self.class_groups = class_groups
        self.every_round = every_round

    def init_state(self, state: dict[str, Any]) -> None:
        state.update(accuracy_matrix=[], correct=[], total=[])

    def evaluate(self, server: ServerProgram, task: int, rnd: int, last: bool, state: dict[str, Any]) -> dict:
        final = last and task == len(self.evaluator.subsets) - 1
        tally = self.prompt_effect_tally() if final else None
        personal = server.personal_models()
        results = self.score(server, personal, task, tally)
        entry: dict[str, Any] = {"accuracy": [r.accuracy for r in results]}
        if self.class_groups is not None:
            entry["class_groups"] = self.group_accuracy(results)
        if last:
            state["accuracy_matrix"].append([r.accuracy for r in results])
            state["correct"] = [r.correct for r in results]
            state["total"] = [r.total for r in results]
            if self.class_groups is not None:
                state["class_groups"] = entry["class_groups"]
            if tally is not None:
                state["prompt_effect"] = tally.result()
            if personal is not None:
                state["scored_model"] = "clients"
            if final:
                state["ablations"] = {
                    name: compare_ablation(server.global_model(), ablated, self.batches(task)).as_dict()
                    for name, ablated in server.ablations().items()
                }
        return entry

    def score(
        self, server: ServerProgram, personal: Any, task: int, tally: PromptEffectTally | None
    ) -> list[TaskResult]:
        """The global model's results on tasks 0..task or, given the server's `personal_models()`, their sum over
        clients: every client is tested on the same images, so the summed counts give the mean over clients of each
        client's accuracy, per task and per class."""
        models = ((None, server.global_model()),) if personal is None else personal
        total: list[TaskResult] | None = None
        for _, model in models:
            results = self.evaluator.evaluate(model, task)
            if tally is not None:
                tally.add(model, self.batches(task))
            total = results if total is None else [add_results(a, b) for a, b in zip(total, results, strict=True)]
        if total is None:
            raise ValueError(f"{type(server).__name__}.personal_models() gave no model to score")
        return total

    def batches(self, after: int) -> Any:
        ev = self.evaluator
        for t in range(after + 1):
            mask = ev.scenario.label_space.eval_mask(t, after, ev.regime)
            for x, y in ev.subsets[t].batches(ev.batch_size, ev.transform, device=ev.device):
                yield x, y, mask

    def learned_tasks(self, state: dict[str, Any]) -> list[LearnedTask]:
        A, space = state["accuracy_matrix"], self.evaluator.scenario.label_space
        return [
            LearnedTask(t, A[t][t], len(self.evaluator.subsets[t]), 100.0 / len(space.tasks[t].logits))
            for t in range(len(A))
        ]

    def group_accuracy(self, results: list[Any]) -> dict[str, float]:
        """Overall / head / mid / tail accuracy over every evaluated task's test images."""
        correct: dict[int, int] = {}
        total: dict[int, int] = {}
        for r in results:
            correct.update(r.class_correct or {})
            total.update(r.class_total or {})
        return class_group_accuracy(correct, total, self.class_groups or {})

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        A = state["accuracy_matrix"]
        groups = {"class_groups": state["class_groups"]} if "class_groups" in state else {}
        return {
            "summary": {**summarize(A, state["correct"], state["total"]), **groups},
            "accuracy_matrix": A,
            "accuracy_curve": accuracy_curve(A),
            **({"scored_model": state["scored_model"]} if "scored_model" in state else {}),
        }


def add_results(a: TaskResult, b: TaskResult) -> TaskResult:
    """Two models' results on the same task's test images, counted together (per class when tallied)."""

    def merged(x: dict[int, int] | None, y: dict[int, int] | None) -> dict[int, int] | None:
        return None if x is None or y is None else {k: x.get(k, 0) + y.get(k, 0) for k in {*x, *y}}

    return TaskResult(
        a.task, a.correct + b.correct, a.total + b.total,
        merged(a.class_correct, b.class_correct), merged(a.class_total, b.class_total),
    )  # fmt: skip


class SlotEvaluator:
    """Masked accuracy per label-space task; each model's logits are computed once per test image and domain.

    A label-space task's test images are seen in its owner client's image domain (`Scenario.client_domain`,
    `scenario.domains`), as the client's training images are."""

    def __init__(
        self, test: ImageSplit, scenario: Scenario, transform: ImageTransform, batch_size: int, device: torch.device
    ) -> None:
        self.test, self.scenario, self.transform = test, scenario, transform
        self.batch_size, self.device = nograd_batch(device, batch_size), device

    def domain(self, g: int) -> ImageDomain | None:
        """The image domain label-space task g is tested in: its owner client's."""
        owners = self.scenario.owners
        return self.scenario.client_domain(owners[g][0]) if owners else None

    @torch.no_grad()
    def logits(self, model: nn.Module, idx: np.ndarray, domain: ImageDomain | None = None) -> torch.Tensor:
        model.eval()
        sub = LabeledSubset(self.test, torch.as_tensor(idx, dtype=torch.long), self.test.targets[idx], domain)
        return torch.cat([model(x).cpu() for x, _ in sub.batches(self.batch_size, self.transform, device=self.device)])

    def task_batches(self, g: int) -> Any:
        """(images, logit targets, slot mask) batches of label-space task g's test images (in its domain)."""
        space, idx = self.scenario.label_space, self.scenario.test_indices[g]
        targets = space.task_class_to_logit(g)[self.test.targets[idx]]
        sub = LabeledSubset(self.test, torch.as_tensor(idx, dtype=torch.long), targets, self.domain(g))
        mask = space.mask(space.tasks[g].logits)
        for x, y in sub.batches(self.batch_size, self.transform, device=self.device):
            yield x, y, mask

    def evaluate(self, model: nn.Module, label_tasks: list[int]) -> list[dict[str, Any]]:
        """{label_task, client, client_task, correct, total, accuracy} per label-space task g that `model` serves;
        its logits are computed once per test image and domain."""
        s, space = self.scenario, self.scenario.label_space
        owners = s.owners or [(0, g) for g in range(len(s.task_classes))]
        by_domain: dict[ImageDomain | None, list[int]] = {}
        for g in label_tasks:
            by_domain.setdefault(self.domain(g), []).append(g)
        out = []
        for domain, groups in by_domain.items():
            union = np.unique(np.concatenate([s.test_indices[g] for g in groups]))
            logits = self.logits(model, union, domain)
            for g in groups:
                pos = torch.as_tensor(np.searchsorted(union, s.test_indices[g]), dtype=torch.long)
                slots = torch.tensor(space.tasks[g].logits, dtype=torch.long)
                target = space.task_class_to_logit(g)[self.test.targets[s.test_indices[g]]] - slots[0]
                pred = logits[pos][:, slots].argmax(dim=1)
                correct, total = int((pred == target).sum()), len(pos)
                out.append(
                    {
                        "label_task": g,
                        "client": owners[g][0],
                        "client_task": owners[g][1],
                        "correct": correct,
                        "total": total,
                        "accuracy": 100.0 * correct / total if total else float("nan"),
                    }
                )
        return out


def points_from_log(log: list[dict[str, Any]], stage_end_only: bool = True) -> list[dict[int, float]]:
    """[evaluation point] → {label_task: accuracy} from the per-(client, task) evaluation log."""
    keys: dict[tuple[int, int], dict[int, float]] = {}
    for r in log:
        if stage_end_only and not r["stage_end"]:
            continue
        keys.setdefault((r["stage"], r["round"]), {})[r["label_task"]] = r["accuracy"]
    return [keys[k] for k in sorted(keys)]


def load_direct_points(run_dir: str | Path) -> list[dict[int, float]]:
    """Stage-end points of a finished direct (single-task) run."""
    path = Path(run_dir) / "metrics.json"
    if not path.is_file():
        raise ConfigError(f"eval.direct_reference: {path} not found; run the direct reference first")
    m = json.loads(path.read_text())
    if "evaluations" not in m:
        raise ConfigError(f"eval.direct_reference: {run_dir} is not a task-aware per-(client, task) run")
    return points_from_log(m["evaluations"])


def slot_summary(
    scenario: Scenario, log: list[dict[str, Any]], direct: list[dict[int, float]] | None = None
) -> dict[str, Any]:
    """Transfer metrics of a run's per-(client, task) evaluation log (FWT/total transfer with a direct log)."""
    points = points_from_log(log)
    finished = [scenario.finished_label_tasks(s) for s in range(len(points))]
    last = [r for r in log if r["stage_end"] and r["stage"] == len(points) - 1]
    if direct is not None and len(direct) != len(points):
        raise ConfigError(f"the direct reference has {len(direct)} evaluation points, this run {len(points)}")
    return transfer_summary(
        points,
        finished,
        direct,
        points_from_log(log, stage_end_only=False),
        sum(r["correct"] for r in last),
        sum(r["total"] for r in last),
    )


SCORED_ORDER = ("global", "client", "task")


def scored_model(keys: dict[int, Hashable | None], owners: list[tuple[int, int]]) -> str:
    """Which model one task-aware evaluation scored, from the `ServerProgram.model_key` of each label-space task g:
    `global` (every g got the global model), `task` (some client's tasks got different models: one model per
    (client, task), Powder, the direct reference) or `client` (client-specific models, one per client, e.g. CPA)."""
    if all(k is None for k in keys.values()):
        return "global"
    per_client: dict[int, set[Hashable | None]] = {}
    for g, k in keys.items():
        per_client.setdefault(owners[g][0], set()).add(k)
    return "task" if any(len(ks) > 1 for ks in per_client.values()) else "client"


class SlotRegime(ServerSideRegime):
    """Task-aware accuracy per (client, task) on its own slots, with the client's model (asynchronous runs)."""

    name = "task_aware_slots"

    def __init__(self, evaluator: SlotEvaluator, cfg: EvalConfig) -> None:
        self.evaluator, self.cfg = evaluator, cfg
        self.scenario = evaluator.scenario
        self.every_round = cfg.every_round

    def init_state(self, state: dict[str, Any]) -> None:
        state["evaluations"] = []

    def evaluate(self, server: ServerProgram, task: int, rnd: int, last: bool, state: dict[str, Any]) -> dict:
        owners, tasks = self.scenario.owners or [], self.scenario.trained_label_tasks(task)
        keys = {g: server.model_key(owners[g][0], g) if self.cfg.model == "auto" else None for g in tasks}
        served: dict[Hashable | None, list[int]] = {}  # model → the tasks it serves: each model is asked for once
        for g in tasks:
            served.setdefault(keys[g], []).append(g)
        tally = self.prompt_effect_tally() if last and task == self.scenario.num_tasks - 1 else None
        results = []
        for key, group in served.items():  # one model at a time: the server may reuse one object for all of them
            model = server.global_model() if key is None else server.client_model(owners[group[0]][0], group[0])
            results += self.evaluator.evaluate(model, group)
            if tally is not None:
                for g in group:
                    tally.add(model, self.evaluator.task_batches(g))
        if tally is not None:
            state["prompt_effect"] = tally.result()
        kind = scored_model(keys, owners)  # the most specific evidence over the run's evaluations
        state["scored_model"] = max(kind, state.get("scored_model", "global"), key=SCORED_ORDER.index)
        results.sort(key=lambda r: r["label_task"])
        for r in results:
            state["evaluations"].append({"stage": task, "round": rnd, "stage_end": last, **r})
        return {"accuracy": {str(r["label_task"]): r["accuracy"] for r in results}}

    def learned_tasks(self, state: dict[str, Any]) -> list[LearnedTask]:
        points, s = points_from_log(state["evaluations"]), self.scenario
        return [
            LearnedTask(g, points[stage][g], len(s.test_indices[g]), 100.0 / len(s.label_space.tasks[g].logits))
            for stage in range(len(points))
            for g in s.finished_label_tasks(stage)
            if g in points[stage]
        ]

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        log = state["evaluations"]
        direct = load_direct_points(self.cfg.direct_reference) if self.cfg.direct_reference else None
        points = points_from_log(log)
        n_tasks = len(self.scenario.task_classes)
        matrix = [[p.get(g) for g in range(n_tasks)] for p in points]
        return {
            "regime": self.name,
            "summary": slot_summary(self.scenario, log, direct),
            "accuracy_matrix": matrix,
            "accuracy_curve": stage_accuracy(points),
            "evaluations": log,
            "direct_reference": self.cfg.direct_reference,
            "scored_model": state.get("scored_model"),
            **self.domains(),
        }

    def domains(self) -> dict[str, Any]:
        """metrics.json `client_domains`: each client's image domain with its parameters, when the scenario has them."""
        if self.scenario.domains is None:
            return {}
        return {"client_domains": [d.describe() for d in self.scenario.domains]}


def check_regime(regime: str, scenario_kind: str) -> None:
    """Refuse an `eval.regime` the scenario kind cannot define (the up-front config check and `build_regime`)."""
    if scenario_kind == "asynchronous" and regime == "task_agnostic":
        raise ConfigError(
            "eval.regime: task_agnostic is undefined on an asynchronous scenario (real classes repeat under "
            "several logits); use task_aware or auto"
        )
    if regime == "client_local" and scenario_kind != "personalized":
        raise ConfigError(
            "eval.regime: client_local tests each client on its local test splits, which only personalized "
            "scenarios hold; set scenario.kind: personalized or eval.regime: auto"
        )


def build_regime(
    cfg: EvalConfig,
    scenario: Scenario,
    test: ImageSplit,
    transform: ImageTransform,
    device: torch.device,
    grid: Grid | None = None,
    retries: int = 0,
    backbone: nn.Module | None = None,
) -> ClassIncrementalRegime | SlotRegime | ClientLocalRegime:
    """The evaluation regime of a run: the one place `eval.regime` is dispatched (`grid`: the run's grid, which the
    client_local regime sends its `evaluate` messages through, asking silent clients again `retries` times;
    `backbone`: the frozen backbone, whose prompts the final evaluation switches off for the prompt effect)."""
    regime = _build_regime(cfg, scenario, test, transform, device, grid, retries)
    if isinstance(regime, ServerSideRegime):
        regime.backbone = backbone
    return regime


def _build_regime(
    cfg: EvalConfig,
    scenario: Scenario,
    test: ImageSplit,
    transform: ImageTransform,
    device: torch.device,
    grid: Grid | None,
    retries: int,
) -> ClassIncrementalRegime | SlotRegime | ClientLocalRegime:
    kind = "personalized" if scenario.personalized else "asynchronous" if scenario.schedule is not None else "other"
    check_regime(cfg.regime, kind)
    if cfg.regime == "client_local" or (cfg.regime == "auto" and scenario.personalized):
        if cfg.class_groups:
            raise ConfigError("eval.class_groups needs the server-side evaluator; use eval.regime: task_agnostic")
        if grid is None:
            raise ValueError("the client_local regime needs the run's grid")
        return ClientLocalRegime(scenario, grid, cfg.batch_size, cfg.retention_every_round or cfg.every_round, retries)
    if scenario.schedule is not None:
        return SlotRegime(SlotEvaluator(test, scenario, transform, cfg.batch_size, device), cfg)
    regime = "task_agnostic" if cfg.regime == "auto" else cfg.regime
    groups = scenario.class_groups if cfg.class_groups is not False else None
    if cfg.class_groups and groups is None:
        raise ConfigError("eval.class_groups: the scenario defines no class groups; use scenario.kind: long_tailed")
    evaluator = Evaluator(test, scenario, transform, cfg.batch_size, device, regime, per_class=groups is not None)
    return ClassIncrementalRegime(evaluator, groups, cfg.every_round)
