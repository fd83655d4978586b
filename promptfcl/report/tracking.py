"""Optional experiment tracking: TensorBoard event files of every round's scalars and the final summary.

Off by default; `engine.tracking: tensorboard` turns it on (the `promptfcl[tracking]` extra, checked up front).
The run loop calls one `Tracker` after each round's log entry is written (`Experiment._run_round`), so every
method and engine gets it without code of its own. What is logged is exactly `rounds.jsonl`: each entry's
numbers (loss, bytes up/down, seconds, the method's diagnostics, …), lists of numbers as `<key>/<i>` (the
per-task accuracies: `accuracy/0` …) and dicts as `<key>/<inner>`, at step `task · rounds_per_task + round`
(tags `task`, `round` and `participants` are the step itself and are left out; `failures` is logged as its count).
After the run the metrics.json summary goes under `summary/…` (plus `communication/mb_per_round` and
`timing/total_seconds`) at the last step, and the resolved config as text.

Files go to `RUN_DIR/tb/`. A resumed run purges what the interrupted process logged after its checkpoint
(`purge_step`) and logs the checkpoint's rounds again, so the event files always match `rounds.jsonl`.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Protocol

from promptfcl.config import ConfigError, ExperimentConfig

SKIPPED = {"task", "round", "participants"}  # the step itself / not a scalar
TB_DIR = "tb"


def check_tracking(cfg: ExperimentConfig) -> None:
    """Refuse `engine.tracking: tensorboard` up front when the tensorboard package is not installed."""
    if cfg.engine.tracking == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "engine.tracking: tensorboard needs the tensorboard package; install it with "
            "pip install 'promptfcl[tracking]' or drop engine.tracking"
        )


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, int | float):
        if math.isfinite(value):
            out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}", v, out)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            if isinstance(v, int | float | dict | list | tuple):
                _flatten(f"{prefix}/{i}", v, out)


def round_scalars(entry: dict[str, Any]) -> dict[str, float]:
    """The scalars of one rounds.jsonl entry, by tag (None / NaN / non-numbers are left out)."""
    out: dict[str, float] = {}
    for key, value in entry.items():
        if key in SKIPPED:
            continue
        if key == "failures":
            out["failures"] = float(len(value or []))
            continue
        _flatten(key, value, out)
    return out


def summary_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The final metrics.json numbers worth a point: the summary, MB per round and total wall time."""
    out: dict[str, float] = {}
    _flatten("summary", metrics.get("summary", {}), out)
    comm, timing = metrics.get("communication", {}), metrics.get("timing", {})
    _flatten("communication/mb_per_round", comm.get("mb_per_round"), out)
    _flatten("timing/total_seconds", timing.get("total_seconds"), out)
    return out


class Tracker(Protocol):
    """Where the run loop sends its per-round log entries and its final metrics."""

    def log_round(self, step: int, entry: dict[str, Any]) -> None: ...

    def log_final(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Writes `round_scalars` / `summary_scalars` with `torch.utils.tensorboard.SummaryWriter`."""

    def __init__(self, run_dir: Path, config_text: str, purge_from: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / TB_DIR), purge_step=purge_from)
        self.writer.add_text("config", "```yaml\n" + config_text + "\n```", 0)

    def log_round(self, step: int, entry: dict[str, Any]) -> None:
        for tag, value in round_scalars(entry).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def log_final(self, step: int, metrics: dict[str, Any]) -> None:
        for tag, value in summary_scalars(metrics).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tracker(cfg: ExperimentConfig, run_dir: Path, config_text: str, resume: bool) -> Tracker | None:
    """The configured tracker (None when tracking is off); a resumed run purges and re-logs from step 0."""
    if cfg.engine.tracking != "tensorboard":
        return None
    check_tracking(cfg)
    return TensorBoardTracker(run_dir, config_text, purge_from=0 if resume else None)
