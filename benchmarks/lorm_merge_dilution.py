"""Why LoRM fails the validity gate in the CPU evidence study: what the end-of-task RegMean merge does to each
task's module.

LoRM (step 5 of `promptfcl.methods.lorm`) evaluates W0 + ΔW*, ΔW* = (Σ_τ B_τA_τG_τ)(Σ_τ G_τ)⁺. When the tasks'
inputs have similar second moments each module enters with weight ≈ 1/t. This script loads a finished LoRM run's
final checkpoint and scores every task (task-agnostic, all seen logits, the final head) with: the merged ΔW* (what
the run is scored with), no adapter at all, and each task's own module alone (W0 + B_τA_τ). It then recomputes
every task's full input Grams (its clients' training images, under its own module: `gram_model: current`) and
re-merges the tasks with RegMean's off-diagonal decay γ ∈ `--gammas` (0: diagonal only, the paper's; 0.5: the
official code's; 1: plain least squares), to tell the merge rule from the modules themselves; it reports each
module's RegMean weight, tr G_τ / tr Σ G (mean over the adapted projections).

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/lorm_merge_dilution.py \\
        benchmarks/results/evidence_cpu/lorm/seed1.replaced-2 [...] --out benchmarks/results/lorm_merge_gamma.json

(`results/lorm_merge_dilution.json` is this script's earlier version, on the diagonal-Gram runs `seed<k>.replaced-1`.)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch

from promptfcl.adapters.lora import FixedDeltas, lora_spec, site_key, site_weight
from promptfcl.backbones.prompt_spec import LoRADelta
from promptfcl.data.loader import LabeledSubset
from promptfcl.evaluation.evaluator import Evaluator
from promptfcl.methods.lorm.gram import input_grams
from promptfcl.methods.lorm.regmean import regmean, regularize_gram
from promptfcl.model import PromptedClassifier
from promptfcl.runtime import Runtime


def diagnose(run: Path, gammas: list[float]) -> dict:
    rt, server = Runtime.restore_server(run)
    past, sites, scale = server.past, server.adapter.sites, server.params.lora_scale
    backbone, scenario = rt.env.backbone, rt.scenario
    ev = Evaluator(rt.dataset.test, scenario, rt.env.eval_transform, 64, rt.device)

    def scored(deltas: dict | None) -> list[float]:
        if deltas is None:
            model = server.global_model()
        else:
            model = PromptedClassifier(backbone, scenario.label_space.num_logits, None)
            model.prompt, model.head = FixedDeltas(deltas), server.model.head
        return [round(r.accuracy, 2) for r in ev.evaluate(model.eval(), len(past) - 1)]

    def own(t: int) -> dict:
        return {s: LoRADelta(past[t]["a"][site_key(s)].float(), past[t]["b"][site_key(s)].float() * scale)
                for s in sites}  # fmt: skip

    modules = {site_key(s): site_weight(backbone, s) for s in sites}
    grams = []  # per task: {site: full Gram of its clients' training inputs under its own module}
    for t in range(len(past)):
        idx = np.concatenate([scenario.client_indices(t, c) for c in range(scenario.num_clients)])
        data = LabeledSubset.of(rt.dataset.train, idx, scenario.label_space.class_to_logit)
        spec = lora_spec(own(t))
        grams.append(input_grams(lambda x, spec=spec: backbone(x, spec), modules, data, rt.env.eval_transform,
                                 rt.device)[0])  # fmt: skip

    def remerged(gamma: float) -> dict:
        out = {}
        for s in sites:
            k = site_key(s)
            gs = [regularize_gram(g[k], gamma) for g in grams]
            dense = [(past[t]["b"][k].double() * scale) @ past[t]["a"][k].double() for t in range(len(past))]
            out[s] = LoRADelta(None, regmean(dense, gs).float())
        return out

    weights = [
        float(np.mean([float(g[site_key(s)].trace() / sum(h[site_key(s)].trace() for h in grams)) for s in sites]))
        for g in grams
    ]
    return {
        "run": str(run),
        "lora_scale": scale,
        "gram_decay_backbone": server.params.gram_decay_backbone,
        "tasks": len(past),
        "merged": scored(None),
        "no_adapter": scored({}),
        "own_module": [scored(own(t)) for t in range(len(past))],
        "remerged_by_gamma": {str(g): scored(remerged(g)) for g in gammas},
        "regmean_weight": weights,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--gammas", default="0,0.5,0.9,1", help="RegMean off-diagonal decays to re-merge the tasks with")
    ap.add_argument("--out", default="benchmarks/results/lorm_merge_gamma.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gammas = [float(g) for g in args.gammas.split(",")]
    rows = []
    for run in args.runs:
        r = diagnose(run, gammas)
        rows.append(r)
        print(f"{run}: merged {r['merged']}, no adapter {r['no_adapter']}")
        for t, acc in enumerate(r["own_module"]):
            print(f"  task {t}'s own module: on its task {acc[t]:.1f} (all {acc}), weight {r['regmean_weight'][t]:.3f}")
        for g, acc in r["remerged_by_gamma"].items():
            print(f"  re-merged with gamma {g}: {acc}")
    Path(args.out).write_text(json.dumps({"rows": rows, "loadavg": list(os.getloadavg())}, indent=2))


if __name__ == "__main__":
    main()
