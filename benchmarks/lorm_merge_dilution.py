"""Why LoRM fails the validity gate in the CPU evidence study: what the end-of-task RegMean merge does to each
task's module.

LoRM (step 5 of `promptfcl.methods.lorm`) evaluates W0 + ΔW*, ΔW* = (Σ_τ B_τA_τG_τ)(Σ_τ G_τ)⁺, with diagonal
Grams (γ_backbone = 0). When the tasks' inputs have similar second moments each module enters with weight
G_τ/ΣG ≈ 1/t per input coordinate. This script loads a finished LoRM run's final checkpoint and scores every
task (task-agnostic, all seen logits, the final head) with: the merged ΔW* (what the run is scored with), no
adapter at all, and each task's own module alone (W0 + B_τA_τ); and it reports each module's mean RegMean weight.

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/lorm_merge_dilution.py \\
        benchmarks/results/evidence_cpu/lorm/seed0 [...] --out benchmarks/results/lorm_merge_dilution.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from promptfcl.adapters.lora import FixedDeltas, site_key
from promptfcl.backbones.prompt_spec import LoRADelta
from promptfcl.evaluation.evaluator import Evaluator
from promptfcl.model import PromptedClassifier
from promptfcl.runtime import Runtime


def diagnose(run: Path) -> dict:
    rt, server = Runtime.restore_server(run)
    past, sites, scale = server.past, server.adapter.sites, server.params.lora_scale
    ev = Evaluator(rt.dataset.test, rt.scenario, rt.env.eval_transform, 64, rt.device)

    def scored(deltas: dict | None) -> list[float]:
        if deltas is None:
            model = server.global_model()
        else:
            model = PromptedClassifier(rt.env.backbone, rt.scenario.label_space.num_logits, None)
            model.prompt, model.head = FixedDeltas(deltas), server.model.head
        return [round(r.accuracy, 2) for r in ev.evaluate(model.eval(), len(past) - 1)]

    def own(t: int) -> dict:
        return {s: LoRADelta(past[t]["a"][site_key(s)].float(), past[t]["b"][site_key(s)].float() * scale)
                for s in sites}  # fmt: skip

    def weight(t: int) -> float:  # mean over sites and input coordinates of G_τ / Σ G (diagonal Grams: ag = A·g)
        w = []
        for s in sites:
            k = site_key(s)
            a, ag = past[t]["a"][k].double(), past[t]["ag"][k].double()
            g = (ag / torch.where(a != 0, a, torch.ones_like(a))).median(dim=0).values
            w.append(float((g / server.gram_sum[k].double().clamp_min(1e-30)).mean()))
        return statistics.mean(w)

    return {
        "run": str(run),
        "tasks": len(past),
        "merged": scored(None),
        "no_adapter": scored({}),
        "own_module": [scored(own(t)) for t in range(len(past))],
        "regmean_weight": [weight(t) for t in range(len(past))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", default="benchmarks/results/lorm_merge_dilution.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    for run in args.runs:
        r = diagnose(run)
        rows.append(r)
        print(f"{run}: merged {r['merged']}, no adapter {r['no_adapter']}")
        for t, acc in enumerate(r["own_module"]):
            print(
                f"  task {t}'s own module: on its task {acc[t]:.1f} (all tasks {acc}), "
                f"weight {r['regmean_weight'][t]:.3f}"
            )
    Path(args.out).write_text(json.dumps({"rows": rows, "loadavg": list(os.getloadavg())}, indent=2))


if __name__ == "__main__":
    main()
