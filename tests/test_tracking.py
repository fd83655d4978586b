"""`engine.tracking: tensorboard`: the event files hold exactly rounds.jsonl's numbers and the final summary, also
after a resume; without the tensorboard package the config is refused up front with the install command."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from promptfcl.config import ConfigError
from promptfcl.experiment import Experiment
from promptfcl.runtime import check_config

from .conftest import tiny_config


def read_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """tag → {step: value}, with TensorBoard's own reader (purges applied); each (tag, step) once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, dict[int, float]] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        assert len({e.step for e in events}) == len(events), f"{tag} logged twice at a step"
        out[tag] = {e.step: e.value for e in events}
    return out


def test_tensorboard_scalars_equal_the_round_log_and_the_summary_also_after_a_resume(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="the promptfcl[tracking] extra (tensorboard) is not installed")
    cfg = tiny_config(engine={"device": "cpu", "tracking": "tensorboard"}, method={"local_epochs": 1})
    metrics = Experiment(cfg, tmp_path, show_progress=False).run()
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    R = cfg.scenario.rounds_per_task

    def check(scalars: dict[str, dict[int, float]]) -> None:
        for r in rounds:
            step = r["task"] * R + r["round"]
            for key in ("bytes_up", "bytes_down", "seconds", "client_seconds", "loss", "clients"):
                assert scalars[key][step] == pytest.approx(r[key], rel=1e-6), (key, step)
            assert scalars["failures"][step] == len(r["failures"])
            for i, acc in enumerate(r.get("accuracy", [])):  # evaluated rounds: per-task accuracy
                assert scalars[f"accuracy/{i}"][step] == pytest.approx(acc, rel=1e-6)
        assert sorted(scalars["bytes_up"]) == list(range(len(rounds)))  # every round, nothing else
        last = len(rounds) - 1
        for key in ("faa", "average_forgetting", "bwt"):
            assert scalars[f"summary/{key}"] == {last: pytest.approx(metrics["summary"][key], rel=1e-6)}

    check(read_scalars(tmp_path / "tb"))
    # a resumed run (here: after its last checkpoint) purges and logs the checkpoint's rounds again, once
    (tmp_path / "metrics.json").unlink()
    Experiment.from_run_dir(tmp_path, show_progress=False).run(resume=True)
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    check(read_scalars(tmp_path / "tb"))


def test_tracking_without_tensorboard_is_refused_with_the_install_command(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'promptfcl\[tracking\]'"):
        check_config(tiny_config(engine={"device": "cpu", "tracking": "tensorboard"}))
    check_config(tiny_config())  # off by default: no tensorboard needed
