"""The promptfcl `ServerApp`: runs the engine-neutral experiment loop with a `FlowerGrid`.

Run config (`flwr run APP --run-config '...'`): `config-file` (experiment YAML, absolute path), `overrides`
(JSON list of `key=value`), `run-dir` (where results go, on the SuperLink's machine), `resume` (bool),
`timeout` (seconds a round waits for replies). Prints one JSON line `{"promptfcl": {...}}` at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid as FlowerGridAPI
from flwr.serverapp import ServerApp

from promptfcl.config import load_config
from promptfcl.experiment import Experiment
from promptfcl.flower.grid import FlowerGrid, discover_partitions
from promptfcl.runtime import Runtime

app = ServerApp()


@app.main()
def main(grid: FlowerGridAPI, context: Context) -> None:
    rc = context.run_config
    cfg = load_config(str(rc["config-file"]), json.loads(str(rc.get("overrides", "[]"))))
    timeout = float(rc.get("timeout", 600.0))

    def make_grid(rt: Runtime) -> FlowerGrid:
        # discovery also waits for each node's worker to build its runtime: allow it the round time limit too
        nodes = discover_partitions(grid, rt.scenario.num_clients, wait_seconds=max(60.0, timeout))
        return FlowerGrid(grid, nodes, timeout=timeout)

    exp = Experiment(cfg, Path(str(rc["run-dir"])), show_progress=False, grid_factory=make_grid, handle_signals=False)
    metrics = exp.run(resume=bool(rc.get("resume", False)))
    print(
        json.dumps(
            {
                "promptfcl": {
                    "run_dir": str(exp.run_dir),
                    "summary": metrics["summary"],
                    "accuracy_matrix": metrics["accuracy_matrix"],
                    "communication": metrics["communication"],
                }
            }
        ),
        flush=True,
    )
