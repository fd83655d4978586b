"""The `client_local` evaluation regime (FedMGP, Yu et al. KDD'24 §5.2 / Table 1 and §3 Definitions 1–2).

Each client tests *its own* model on its local test split of each task it has seen, with the logits outside that
task's classes masked (task-aware). Since personal parts (FedMGP's local prompts and per-task heads) never
leave the client, the test runs on the client: the server sends an `evaluate` message through the `Grid` (so it
works on every engine) carrying the shared model (`ServerProgram.evaluate_message`), and the client answers with
correct / total counts. Reported per task (mean over clients of each client's accuracy on its t-th task) and
averaged over tasks.

Knowledge retention, per round r (the paper's Eq. 1 and 2):
- θ_i^r, client i's *local* model = its model right after its local training of round r (before aggregation); the
  client measures it on its task 0 and current task and keeps the counts in its state (`remember_local`).
- θ_g^r, the global model = what the client holds after the server's aggregation of round r (for FedAvg methods
  the averaged model; for FedMGP the fused global prompts with its own local prompts and heads).
- KR_t^r = mean_i Acc(θ_i^r; T_i^0) / Acc(θ_i^0; T_i^0), where θ_i^0 is the local model when task 0 was learned
  (its last round; the paper's "initial round"), so KR_t is defined from the last round of task 0 on.
- KR_s^r = mean_i Acc(θ_g^r; T_i^r) / Acc(θ_i^r; T_i^r) over clients that trained in round r.
Measured after every round (`eval.retention_every_round`, default) or only after each task's last round; the
regime stamps `measure_local` on the messages of the rounds it evaluates (`round_stamp`, set on the grid before
`server.run_round`), so clients test θ_i^r only then. `build_regime` (`evaluation.regimes`) dispatches here.
Evaluation traffic is not counted as communication (the round's bytes are logged before it runs).
A client that does not answer the `evaluate` message is asked again, up to `engine.round_retries` times (as
a retry attempt of the round, so a fault plan's `attempts` apply); clients still silent are listed in the
round's `eval_missing` and left out of that evaluation's means (a warning is printed), so a lost measurement is
visible instead of silently shrinking the average.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from promptfcl.data.loader import LabeledSubset, nograd_batch
from promptfcl.data.transforms import ImageTransform
from promptfcl.evaluation.evaluator import TaskResult
from promptfcl.evaluation.metrics import accuracy_curve, spatial_retention, summarize, temporal_retention
from promptfcl.evaluation.prompt_effect import PromptEffect, compare_predict, prompt_effect_applies
from promptfcl.evaluation.validity import LearnedTask
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import ClientContext, Grid, MethodEnv, RoundFailed, ServerProgram
from promptfcl.scenario.label_space import masked_logits
from promptfcl.scenario.scenario import Scenario

Predict = Callable[[torch.Tensor, int], torch.Tensor]  # (images, task) → logits over the label space
LOCAL_KEY = "eval/local"  # client state scalar: the local model's counts of its latest training round


@torch.no_grad()
def count_correct(
    predict: Predict, data: LabeledSubset, task: int, mask: torch.Tensor, transform: ImageTransform,
    batch_size: int, device: torch.device,
) -> list[int]:  # fmt: skip
    """[correct, total] of `predict` on `data` with the logits outside `mask` set to -inf."""
    mask = mask.to(device)
    correct = 0
    for x, y in data.batches(nograd_batch(device, batch_size), transform, device=device):
        correct += int((masked_logits(predict(x, task), mask).argmax(dim=1) == y).sum())
    return [correct, len(data)]


def measure(
    predict: Predict, ctx: ClientContext, env: MethodEnv, tasks: list[int], batch_size: int
) -> dict[str, list[int]]:
    """{task: [correct, total]} on this client's local test split of each task, task-aware."""
    if ctx.local_test is None:
        raise ValueError("the client_local regime needs a personalized scenario (clients hold no local test split)")
    space = ctx.space(env)
    return {
        str(t): count_correct(
            predict, ctx.local_test(t), t, space.mask(space.tasks[t].logits), env.eval_transform, batch_size, ctx.device
        )
        for t in tasks
    }


MEASURE = "measure_local"  # stamped on a round's messages when the regime evaluates after that round


def remember_local(
    predict: Predict, ctx: ClientContext, env: MethodEnv, message: Message, batch_size: int = 256
) -> None:
    """After local training in a round the regime evaluates: keep θ_i^r's counts on tasks 0 and current."""
    if ctx.local_test is None or not message.scalars.get(MEASURE, False):
        return
    counts = measure(predict, ctx, env, sorted({0, ctx.stage}), batch_size)
    ctx.state.scalars[LOCAL_KEY] = {"task": ctx.stage, "round": ctx.round, "counts": counts}


def evaluate_reply(
    predict: Predict, ctx: ClientContext, env: MethodEnv, message: Message, diagnostics: dict[str, float] | None = None
) -> Message:
    """The answer to an `evaluate` message: the held model's counts on the requested tasks + the local counts
    (+ method-specific `diagnostics`, averaged over clients into the round's metrics as `diag/<name>`)."""
    tasks = [int(t) for t in message.scalars["tasks"]]
    batch_size = int(message.scalars.get("batch_size", 256))
    counts = measure(predict, ctx, env, tasks, batch_size)
    scalars = {"global": counts, "local": ctx.state.scalars.get(LOCAL_KEY), "diagnostics": diagnostics or {}}
    if message.scalars.get(PROMPT_EFFECT) and hasattr(env.backbone, "prompts_disabled"):
        scalars[PROMPT_EFFECT] = prompt_effect_counts(predict, ctx, env, tasks, batch_size)
    return Message({}, scalars, kind="evaluate_reply")


PROMPT_EFFECT = "prompt_effect"  # set on the final evaluation: clients also predict without prompts


def prompt_effect_counts(
    predict: Predict, ctx: ClientContext, env: MethodEnv, tasks: list[int], batch_size: int
) -> dict[str, int]:
    """With / without prompts counts of the held model on the local test splits of `tasks` (validity gate)."""
    space, effect = ctx.space(env), PromptEffect()
    for t in tasks:
        mask = space.mask(space.tasks[t].logits)
        data = ctx.local_test(t).batches(nograd_batch(ctx.device, batch_size), env.eval_transform, device=ctx.device)
        batches = ((x, y, mask) for x, y in data)
        compare_predict(lambda x, t=t: predict(x, t), env.backbone, batches, effect)
    return {k: effect.__dict__[k] for k in ("total", "changed", "correct_on", "correct_off", "gained", "lost")}


@dataclass
class ClientMeanResult(TaskResult):
    """A task's result in the client_local regime: counts summed over clients, accuracy = mean over clients."""

    client_accuracy: float = float("nan")

    @property
    def accuracy(self) -> float:  # type: ignore[override]
        return self.client_accuracy


def _acc(c: list[int]) -> float:
    return 100.0 * c[0] / c[1] if c[1] else float("nan")


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


def _mean(values: list[float]) -> float:
    ok = [v for v in values if v == v]
    return sum(ok) / len(ok) if ok else float("nan")


class ClientLocalRegime:
    """Server side of the regime: asks every client through the grid, aggregates per task, tracks KR_t / KR_s per
    round. The summary gains `kr_t` / `kr_s` (last evaluated round) and `task_accuracy` (final per-task local
    accuracy), so study tables show them as columns; `retention` keeps the per-round curves."""

    name = "client_local"
    evaluator = None  # no server-side test-split evaluator

    def __init__(self, scenario: Scenario, grid: Grid, batch_size: int, every_round: bool, retries: int = 0) -> None:
        self.scenario = scenario
        self.grid = grid
        self.batch_size = batch_size
        self.every_round = every_round
        self.retries = retries

    def round_stamp(self, last: bool) -> dict[str, Any]:
        """Scalars for this round's messages: trained clients measure their local model when we evaluate."""
        return {MEASURE: True} if last or self.every_round else {}

    def init_state(self, state: dict[str, Any]) -> None:
        state.update(accuracy_matrix=[], correct=[], total=[], retention={"reference": {}, "rounds": []})

    def evaluate(self, server: ServerProgram, task: int, rnd: int, last: bool, state: dict[str, Any]) -> dict:
        t = task
        tasks = list(range(t + 1)) if last else sorted({0, t})
        msg = server.evaluate_message()
        msg.scalars.update({"tasks": tasks, "batch_size": self.batch_size})
        final = last and t == self.scenario.num_tasks - 1
        if final:
            msg.scalars[PROMPT_EFFECT] = True
        replies, missing = self.ask_every_client(msg)
        if final:
            counts = [r.scalars[PROMPT_EFFECT] for r in replies.values() if PROMPT_EFFECT in r.scalars]
            if counts:
                effect = PromptEffect()
                for c in counts:
                    effect.add_counts(c)
                state[PROMPT_EFFECT] = effect.as_dict(applicable=prompt_effect_applies(server.global_model()))
        held = {c: r.scalars["global"] for c, r in replies.items()}
        local = {
            c: r.scalars["local"]["counts"]
            for c, r in replies.items()
            if r.scalars.get("local") and (r.scalars["local"]["task"], r.scalars["local"]["round"]) == (t, rnd)
        }
        ret = state["retention"]
        if t == 0 and last:  # θ_i^0: the local model when task 0 is learned
            ret["reference"] = {str(c): _acc(v["0"]) for c, v in local.items() if v["0"][1]}
        ref = ret["reference"]
        now_first = [(_acc(v["0"]), ref[str(c)]) for c, v in local.items() if str(c) in ref]
        kr_t = temporal_retention([a for a, _ in now_first], [b for _, b in now_first]) if now_first else float("nan")
        pairs = [(_acc(held[c][str(t)]), _acc(v[str(t)])) for c, v in local.items() if c in held]
        kr_s = spatial_retention([a for a, _ in pairs], [b for _, b in pairs]) if pairs else float("nan")
        ret["rounds"].append({"task": t, "round": rnd, "kr_t": _finite(kr_t), "kr_s": _finite(kr_s)})
        entry: dict[str, Any] = {"kr_t": kr_t, "kr_s": kr_s}
        if missing:
            entry["eval_missing"] = missing
        names = sorted({k for r in replies.values() for k in r.scalars.get("diagnostics", {})})
        for name in names:
            vals = [
                r.scalars["diagnostics"][name] for r in replies.values() if name in r.scalars.get("diagnostics", {})
            ]
            entry[f"diag/{name}"] = _finite(_mean([float(v) for v in vals]))
        if not last:
            return entry
        results: list[TaskResult] = []
        for j in tasks:
            per_client = [held[c][str(j)] for c in sorted(held)]
            correct, total = sum(x[0] for x in per_client), sum(x[1] for x in per_client)
            results.append(ClientMeanResult(j, correct, total, client_accuracy=_mean([_acc(x) for x in per_client])))
        entry["accuracy"] = [r.accuracy for r in results]
        entry["client_accuracy"] = {str(c): {j: _finite(_acc(v)) for j, v in held[c].items()} for c in sorted(held)}
        state["accuracy_matrix"].append([r.accuracy for r in results])
        state["correct"] = [r.correct for r in results]
        state["total"] = [r.total for r in results]
        return entry

    def learned_tasks(self, state: dict[str, Any]) -> list[LearnedTask]:
        """Task t's mean client accuracy right after it, its local test images and mean chance over clients."""
        A, s = state["accuracy_matrix"], self.scenario
        tests, tasks = s.client_test or [], s.client_tasks or []
        out = []
        for t in range(len(A)):
            sizes = [len(tests[t][c]) for c in range(s.num_clients) if t < len(tests)]
            chance = [100.0 / len(tasks[c][t]) for c in range(s.num_clients) if t < len(tasks[c]) and tasks[c][t]]
            if sizes and chance:
                out.append(LearnedTask(t, A[t][t], sum(sizes), sum(chance) / len(chance)))
        return out

    def ask_every_client(self, msg: Message) -> tuple[dict[int, Message], list[int]]:
        """Every client's `evaluate` reply; silent clients are asked again (as retry attempts of the round)."""
        replies: dict[int, Message] = {}
        missing = list(range(self.scenario.num_clients))
        for attempt in range(self.retries + 1):
            if attempt:
                self.grid.start_round(self.grid.round, self.grid.attempt + 1)
            with contextlib.suppress(RoundFailed):  # fewer replies than engine.min_clients: none usable this time
                replies.update(self.grid.broadcast(missing, msg))
            missing = [c for c in missing if c not in replies]
            if not missing:
                break
        if missing:
            warnings.warn(
                f"clients {missing} did not answer the evaluation; their accuracies are left out", stacklevel=2
            )
        return replies, missing

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        A, ret = state["accuracy_matrix"], state["retention"]
        last = ret["rounds"][-1] if ret["rounds"] else {}
        summary = {
            **summarize(A, state["correct"], state["total"]),
            "task_accuracy": {str(j + 1): a for j, a in enumerate(A[-1] if A else [])},
            "kr_t": last.get("kr_t"),
            "kr_s": last.get("kr_s"),
        }
        return {
            "regime": self.name,
            "summary": summary,
            "accuracy_matrix": A,
            "accuracy_curve": accuracy_curve(A),
            "retention": {"rounds": ret["rounds"], "reference": ret["reference"]},
        }
