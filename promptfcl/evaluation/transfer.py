"""Powder / C2Prompt's transfer metrics, computed from a run's per-(client, task) evaluation log.

Inputs: `points[s]` = {label-space task g: accuracy (%)} of every (client, task) trained so far, evaluated at the
end of stage s (s = 0..S−1); `finished[s]` = the label-space tasks whose training ends with stage s (their client
switches at s+1, or the run ends); `direct[s]` = the same log of a `direct` single-task run (same scenario).
Definitions (Powder's `src/benchmark_metrics.py`, with the task lists derived from the schedule, not hand-written):

- Acc = mean_s mean_{g ∈ points[s]} a_s(g)  (C2Prompt's "Avg").
- Forgetting_s = mean_{g ∈ points[s]} (max_{s' < s} a_{s'}(g) − a_s(g)), a task's first evaluation counting 0;
  forgetting = mean_s Forgetting_s.
- BWT_s = mean over g finished at some s' < s of (a_s(g) − a_{s'}(g)) (accuracy now minus when it finished);
  BWT = mean over the points where it is defined.
- FWT_s = mean_{g ∈ finished[s]} (a_s(g) − direct_s(g)); FWT = mean over the points where it is defined.
  (Powder's script pairs its last point with the direct run's first — a slip not reproduced here.)
- Total transfer = (Σ_s FWT_s + Σ_s BWT_s) / S, an undefined term counting 0 — the value Powder's
  `calculate_total_transfer` computes.
- AIA (time-averaged accuracy) = mean over every evaluated round of the mean accuracy over the tasks trained so
  far; with evaluation only at stage ends it equals Acc, with `eval.every_round` it also weighs how fast each task
  is learned (our reading: the sources do not define AIA).
- FAA = mean_{g ∈ points[S−1]} a_{S−1}(g) (final average accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

Points = Sequence[Mapping[int, float]]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def stage_accuracy(points: Points) -> list[float]:
    """Mean accuracy over the tasks trained so far, per evaluation point."""
    return [_mean(list(p.values())) for p in points]


def accuracy(points: Points) -> float:
    return _mean(stage_accuracy(points))


def forgetting_per_stage(points: Points) -> list[float]:
    best: dict[int, float] = {}
    out = []
    for p in points:
        drops = [best[g] - a if g in best else 0.0 for g, a in p.items()]
        out.append(_mean(drops))
        for g, a in p.items():
            best[g] = max(best.get(g, -math.inf), a)
    return out


def forgetting(points: Points) -> float:
    return _mean(forgetting_per_stage(points))


def bwt_per_stage(points: Points, finished: Sequence[Sequence[int]]) -> list[float]:
    """BWT_s (NaN where no task finished before s)."""
    at_finish: dict[int, float] = {}
    out = []
    for s, p in enumerate(points):
        out.append(_mean([p[g] - a0 for g, a0 in at_finish.items() if g in p]))
        for g in finished[s]:
            if g in p:
                at_finish[g] = p[g]
    return out


def fwt_per_stage(points: Points, direct: Points, finished: Sequence[Sequence[int]]) -> list[float]:
    """FWT_s (NaN where no task finished at s)."""
    return [
        _mean([points[s][g] - direct[s][g] for g in finished[s] if g in points[s] and g in direct[s]])
        for s in range(len(points))
    ]


def _defined_mean(xs: Sequence[float]) -> float:
    return _mean([x for x in xs if not math.isnan(x)])


def total_transfer(fwt_s: Sequence[float], bwt_s: Sequence[float]) -> float:
    S = max(len(fwt_s), len(bwt_s))
    tot = sum(x for x in fwt_s if not math.isnan(x)) + sum(x for x in bwt_s if not math.isnan(x))
    return tot / S if S else math.nan


def transfer_summary(
    points: Points,
    finished: Sequence[Sequence[int]],
    direct: Points | None = None,
    all_points: Points | None = None,
    correct: int = 0,
    total: int = 0,
) -> dict[str, float]:
    """Every headline number of a task-aware per-(client, task) run (FWT / total transfer need `direct`)."""
    bwt_s = bwt_per_stage(points, finished)
    fwt_s = fwt_per_stage(points, direct, finished) if direct is not None else []
    out = {
        "acc": accuracy(points),
        "aia": accuracy(all_points if all_points else points),
        "faa": stage_accuracy(points)[-1] if points else math.nan,
        "sample_weighted_accuracy": 100.0 * correct / total if total else math.nan,
        "average_forgetting": forgetting(points),
        "bwt": _defined_mean(bwt_s),
        "fwt": _defined_mean(fwt_s) if direct is not None else math.nan,
        "total_transfer": total_transfer(fwt_s, bwt_s) if direct is not None else math.nan,
    }
    return out
