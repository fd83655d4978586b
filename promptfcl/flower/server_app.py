"""The promptfcl `ServerApp`: runs the engine-neutral experiment loop with a `FlowerGrid`.

Run config (`flwr run APP --run-config '...'`): `config-file` (experiment YAML, absolute path), `overrides`
(JSON list of `key=value`), `run-dir` (where results go, on the SuperLink's machine), `resume` (bool),
`timeout` (seconds a round waits for replies). Prints one JSON line `{"promptfcl": {...}}` at the end.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid as FlowerGridAPI
from flwr.serverapp import ServerApp

from promptfcl.config import ConfigError, load_config
from promptfcl.experiment import Experiment
from promptfcl.flower.grid import (
    DEFAULT_LIVENESS_INTERVAL,
    DEFAULT_TIMEOUT_FACTOR,
    FlowerGrid,
    discover_partitions,
)
from promptfcl.runtime import Runtime

app = ServerApp()


def _positive(run_config: Mapping[str, Any], key: str, default: float) -> float:
    try:
        value = float(run_config.get(key, default))
    except (TypeError, ValueError):
        raise ConfigError(f"run config {key} = {run_config.get(key)!r}: give a number; fix --run-config") from None
    if not value > 0:
        raise ConfigError(f"run config {key} = {value}: must be > 0 (seconds or a factor); fix --run-config")
    return value


@app.main()
def main(grid: FlowerGridAPI, context: Context) -> None:
    rc = context.run_config
    cfg = load_config(str(rc["config-file"]), json.loads(str(rc.get("overrides", "[]"))))
    timeout = _positive(rc, "timeout", 600.0)
    factor = _positive(rc, "timeout-factor", DEFAULT_TIMEOUT_FACTOR)
    liveness = _positive(rc, "liveness-interval", DEFAULT_LIVENESS_INTERVAL)

    def make_grid(rt: Runtime) -> FlowerGrid:
        # discovery also waits for each node's worker to build its runtime: allow it the round time limit too
        nodes = discover_partitions(grid, rt.scenario.num_clients, wait_seconds=max(60.0, timeout))
        return FlowerGrid(grid, nodes, timeout=timeout, timeout_factor=factor, liveness_interval=liveness)

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
