"""Why a run's last task sits near the gate's floor right after it is learned: learning or calibration?

`learned_tasks` scores each task right after it is learned with every seen class competing (task-agnostic). A
task can fail it in two ways: the model did not learn to tell the task's classes apart (its within-task accuracy,
only the task's own logits competing, is low too), or it did, but the task's logits lose to older tasks' logits
(within-task accuracy high, most wrong predictions land on older classes: a cross-task calibration failure, which
a masked-CE head trained one task at a time is prone to and HGP's server-side rebalancing is built to fix).

For each finished run this loads the final checkpoint and scores the last task (whose task-end model is the final
one) both ways, with the share of its test images predicted into older tasks' classes and each task's mean
head-row norm. One run takes a few seconds on a CPU core.

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/task_recency.py \\
        benchmarks/results/evidence_v2_dirichlet/lorm/seed{0,1,2,3,4} ... --out benchmarks/results/task_recency.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from promptfcl.evaluation.evaluator import Evaluator
from promptfcl.runtime import Runtime
from promptfcl.scenario.label_space import masked_logits


def head_row_norms(model: torch.nn.Module, tasks: list) -> list[float] | None:
    """Mean L2 norm of each task's head rows (None when the model has no linear head)."""
    head = getattr(model, "head", None)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return [round(float(weight[list(t.logits)].norm(dim=1).mean()), 4) for t in tasks]


@torch.no_grad()
def diagnose(run: Path) -> dict:
    rt, server = Runtime.restore_server(run)
    scenario, space = rt.scenario, rt.scenario.label_space
    last = scenario.num_tasks - 1
    model = server.global_model().eval()
    out: dict = {"run": str(run), "method": rt.cfg.method.name}
    evaluators = {r: Evaluator(rt.dataset.test, scenario, rt.env.eval_transform, 64, rt.device, regime=r)
                  for r in ("task_agnostic", "task_aware")}  # fmt: skip
    for regime, ev in evaluators.items():
        out[regime] = [round(r.accuracy, 2) for r in ev.evaluate(model, last)]
    ev = evaluators["task_agnostic"]
    older = space.mask([j for t in space.tasks[:last] for j in t.logits])
    seen = space.seen_mask(last)
    into_older, total = 0, 0
    for x, _ in ev.subsets[last].batches(ev.batch_size, ev.transform, device=ev.device):
        pred = masked_logits(model(x), seen).argmax(dim=1).cpu()
        into_older += int(older[pred].sum())
        total += len(pred)
    out["last_task_into_older_classes"] = round(100.0 * into_older / total, 2)
    out["head_row_norm_per_task"] = head_row_norms(model, space.tasks[: last + 1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run directories")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    print("| run | task-agnostic, last task | within the task | last task's images into older classes | "
          "head-row norm per task |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for run in args.runs:
        r = diagnose(run)
        results.append(r)
        print(
            f"| {run.parent.name}/{run.name} | {r['task_agnostic'][-1]:.1f} | {r['task_aware'][-1]:.1f} | "
            f"{r['last_task_into_older_classes']:.1f} % | {r['head_row_norm_per_task']} |"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
