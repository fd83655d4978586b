"""Which synchronised part of CAPT's last global synchronisation changes the global model's accuracy?

Reads a finished CAPT run directory (its final checkpoint, after the last round) and the checkpoint of the round
before it, and evaluates on the run's test set the final server model, the model after the previous round, and the
final model with each synchronised part (the coupling F, the general prompt P_g, the class-aware prompts P_c) put
back to its value after the previous round. Prints a table and writes it as JSON.

    PROMPTFCL_ASSETS=... python benchmarks/capt_last_sync.py RUN_DIR OUT.json

RUN_DIR needs `checkpoint.safetensors` and `checkpoint.prev.safetensors` (kept by every run, git-ignored).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from promptfcl.checkpoint import PREVIOUS_NAME, verify_checkpoint
from promptfcl.evaluation.evaluator import Evaluator
from promptfcl.federation.message import unprefixed
from promptfcl.runtime import Runtime

PARTS = {"coupling F": ("coupling.",), "general prompt P_g": ("ctx", "deep_ctx"), "class prompts P_c": ("class_ctx",)}


def part_of(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether a server-state key belongs to a part (`ctx` is not a prefix of `class_ctx`)."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    rt, server = Runtime.restore_server(args.run_dir)
    final = {k: v.clone() for k, v in server.model.get_state().items()}
    prev = unprefixed(verify_checkpoint(args.run_dir / PREVIOUS_NAME)[0], "server/")  # the round before
    evaluator = Evaluator(rt.dataset.test, rt.scenario, rt.env.eval_transform, 128, rt.device)

    def accuracy(state: dict[str, torch.Tensor]) -> float:  # the run's single task, task-agnostic as in the run
        server.model.set_state(state)
        return evaluator.evaluate(server.model, 0)[0].accuracy

    out = {"final (after the last round)": accuracy(final), "after the previous round": accuracy(
        {k: prev[k] for k in final})}  # fmt: skip
    for name, prefixes in PARTS.items():
        state = {k: prev[k] if part_of(k, prefixes) else v for k, v in final.items()}
        out[f"final, {name} from the previous round"] = accuracy(state)
    for k, v in out.items():
        print(f"{k}: {v:.2f} %")
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
