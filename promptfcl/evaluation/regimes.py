"""The one dispatch from `eval.regime` to how a run is evaluated after a round.

- `task_agnostic` / `task_aware`: the server tests `server.global_model()` on the test split of every seen task
  (`Evaluator`), after each task (and every round with `eval.every_round`).
- `client_local`: every client tests its own model on its local test splits through `evaluate` messages, with
  KR_t / KR_s per round (`ClientLocalEvaluation`; personalized scenarios).

Both answer `round_stamp(info, last)` (scalars stamped on the round's messages before it runs) and
`evaluate_round(server, grid, info, last, progress)` with None (nothing evaluated this round) or (per-task
results or None, extra round metrics).
"""

from __future__ import annotations

from typing import Any

import torch

from promptfcl.config import EvalConfig
from promptfcl.data.base import ImageSplit
from promptfcl.data.transforms import ImageTransform
from promptfcl.evaluation.client_local import ClientLocalEvaluation
from promptfcl.evaluation.evaluator import Evaluator, TaskResult
from promptfcl.federation.protocol import Grid, RoundInfo, ServerProgram
from promptfcl.scenario.scenario import Scenario


class ServerEvaluation:
    """The server-side regimes: the global model on the test split of every seen task."""

    def __init__(self, evaluator: Evaluator, every_round: bool) -> None:
        self.evaluator = evaluator
        self.every_round = every_round

    def round_stamp(self, info: RoundInfo, last: bool) -> dict[str, Any]:
        return {}

    def evaluate_round(
        self, server: ServerProgram, grid: Grid, info: RoundInfo, last: bool, progress: dict[str, Any]
    ) -> tuple[list[TaskResult] | None, dict[str, Any]] | None:
        if not (last or self.every_round):
            return None
        return self.evaluator.evaluate(server.global_model(), info.task), {}


def build_evaluation(
    cfg: EvalConfig,
    test: ImageSplit,
    scenario: Scenario,
    transform: ImageTransform,
    device: torch.device,
    per_class: bool = False,
) -> ServerEvaluation | ClientLocalEvaluation:
    """The evaluation of a run under `cfg.regime` (`per_class`: the server evaluator also tallies real classes)."""
    if cfg.regime == "client_local":
        if per_class:
            raise ValueError("class-group accuracy needs the server-side evaluator; use eval.regime: task_agnostic")
        return ClientLocalEvaluation(scenario, cfg.batch_size, cfg.retention_every_round or cfg.every_round)
    evaluator = Evaluator(test, scenario, transform, cfg.batch_size, device, cfg.regime, per_class=per_class)
    return ServerEvaluation(evaluator, cfg.every_round)
