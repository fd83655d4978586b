"""Where a prompt pool's training signal goes in the asynchronous evidence family: how far each client moves the
prompts in its local epochs, and how much of that move survives FedAvg.

Runs the first rounds of task 0 of a study cell's config (by default the evidence study's Fed-CODAP cell, seed 0)
for several local-epoch budgets and records, per round and per prompt tensor (pool components, keys, attention
vectors) and for the head: the clients' mean update norm ‖Δ_c‖, the norm of the FedAvg update ‖mean_c Δ_c‖ and
their ratio (1: the clients agree; 1/√N: independent directions), and each client's RMS move per element against
Adam's ceiling lr × steps (every step moving every element by lr in one direction). The RMS is over the whole
tensor, drawn and not-yet-drawn components alike (a CODA-P pool draws 1 / num_tasks of them per task).

    PROMPTFCL_ASSETS=/path/to/assets python benchmarks/prompt_update_cancellation.py \\
        --out benchmarks/results/prompt_update_cancellation.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

import torch

from promptfcl.config import build_config
from promptfcl.federation.inprocess import InProcessGrid
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import RoundInfo
from promptfcl.runtime import Runtime
from promptfcl.study import cell_config, load_study


def tracked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().clone() for k, v in state.items() if k.startswith(("prompt.", "head."))}


def one_budget(cfg_dict: dict, epochs: int, rounds: int) -> list[dict]:
    cfg_dict = {**cfg_dict, "method": {**cfg_dict["method"], "local_epochs": epochs}}
    rt = Runtime.build(build_config(cfg_dict))
    server, client = rt.programs()
    replies: dict[int, dict[str, torch.Tensor]] = {}

    def keep(cid: int, reply: Message) -> None:
        replies[cid] = {k: v.detach().double().clone() for k, v in reply.tensors.items()}

    grid = InProcessGrid(client, rt.scenario, rt.dataset.train, rt.cfg.seed, rt.device, on_reply=keep)
    server.begin_stage(0)
    p = rt.params
    rows = []
    for rnd in range(rounds):
        before = tracked(server.global_model().state_dict())
        replies.clear()
        info = RoundInfo(0, rnd, tuple(rt.scenario.participants[0][rnd]))
        server.run_round(grid, info)
        after = tracked(server.global_model().state_dict())
        steps = epochs * max(math.ceil(len(rt.scenario.client_indices(0, c)) / p.batch_size) for c in replies)
        row: dict = {"local_epochs": epochs, "round": rnd, "steps_per_client": steps, "tensors": {}}
        for k, b in before.items():
            deltas = [r[k] - b for r in replies.values() if k in r and r[k].shape == b.shape]
            if not deltas:
                continue
            client_norm = statistics.mean(float(d.norm()) for d in deltas)
            fedavg = float((after[k] - b).norm())
            row["tensors"][k] = {
                "init_norm": float(b.norm()),
                "client_update_norm": client_norm,
                "fedavg_update_norm": fedavg,
                "fedavg_over_client": fedavg / client_norm if client_norm else float("nan"),
                "client_rms_per_element": statistics.mean(float(d.pow(2).mean().sqrt()) for d in deltas),
                "adam_ceiling_per_element": p.lr * steps,
                "clients": len(deltas),
            }
        rows.append(row)
        print(f"epochs {epochs} round {rnd} ({steps} steps per client)")
        for k, v in row["tensors"].items():
            print(
                f"  {k}: |init| {v['init_norm']:.3f} client |d| {v['client_update_norm']:.4f} FedAvg |d| "
                f"{v['fedavg_update_norm']:.4f} (x{v['fedavg_over_client']:.2f}), rms/elem "
                f"{v['client_rms_per_element']:.2e} vs ceiling {v['adam_ceiling_per_element']:.2e}"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--study", default="benchmarks/evidence_cpu.yaml")
    ap.add_argument("--cell", default="fedcodap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/prompt_update_cancellation.json")
    args = ap.parse_args()
    study, study_dir = load_study(args.study)
    cfg = cell_config(study, study_dir, args.cell, args.seed)
    cfg_dict = cfg.model_dump(mode="json")
    rows = [r for e in args.epochs for r in one_budget(cfg_dict, e, args.rounds)]
    out = {"cell": args.cell, "seed": args.seed, "load_average": os.getloadavg(), "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
