"""Shared fixtures: a tiny synthetic experiment config that runs in seconds, and the shared-assets path."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from promptfcl.config import ExperimentConfig, build_config
from promptfcl.federation.inprocess import InProcessGrid
from promptfcl.federation.message import Message

TINY: dict[str, Any] = {
    "name": "tiny",
    "seed": 0,
    "data": {"name": "synthetic", "options": {"num_classes": 6, "train_per_class": 40, "test_per_class": 8}},
    "scenario": {
        "num_tasks": 2,
        "num_clients": 3,
        "rounds_per_task": 2,
        "partition": {"kind": "dirichlet", "beta": 0.5, "min_samples": 2},
    },
    "backbone": {
        "name": "vit_tiny_patch16_224",
        "img_size": 32,
        "kwargs": {"patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 3},
    },
    "method": {"name": "fedavg_prompt", "layers": [0, 1], "local_epochs": 2, "batch_size": 8, "lr": 0.01},
    "engine": {"device": "cpu"},
}


def load_benchmark(name: str) -> Any:
    """The module of `benchmarks/<name>.py` (scripts, not a package), registered under `name`."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def deep_update(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in updates.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_raw(**updates: Any) -> dict[str, Any]:
    return deep_update(TINY, updates)


def tiny_config(**updates: Any) -> ExperimentConfig:
    return build_config(tiny_raw(**updates))


class RecordingGrid(InProcessGrid):
    """The in-process engine, keeping every delivered batch of messages and its replies whole, per delivery:
    `log` holds (task, round, messages, replies). A folding server keeps only part of each reply; the log keeps
    what the client sent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, int, dict[int, Message], dict[int, Message]]] = []
        self.whole: dict[int, Message] = {}

    @property
    def sent(self) -> list[dict[int, Message]]:
        return [m for _, _, m, _ in self.log]

    @property
    def replies(self) -> list[dict[int, Message]]:
        return [r for _, _, _, r in self.log]

    def _received(self, cid: int, sent: Message, reply: Message) -> Message | None:
        self.whole[cid] = reply.copy()
        return super()._received(cid, sent, reply)

    def _deliver(self, messages: dict[int, Message]) -> dict[int, Message]:
        self.whole = {}
        sent = {c: m.copy() for c, m in messages.items()}
        replies = super()._deliver(messages)
        whole = {c: self.whole.get(c, r).copy() for c, r in replies.items()}
        self.log.append((self.round.stage, self.round.round, sent, whole))
        return replies


def interrupted_then_resumed(cfg: ExperimentConfig, run_dir: Path, rounds: int) -> dict[str, Any]:
    """Run `cfg` in `run_dir`, interrupt it (KeyboardInterrupt) after `rounds` completed rounds, then resume it
    from its checkpoint; returns the resumed run's metrics (to compare with an uninterrupted run)."""
    from promptfcl.experiment import Experiment

    exp = Experiment(cfg, run_dir, show_progress=False)
    original, done = exp._run_round, []

    def interrupted(task: int, rnd: int) -> None:
        if len(done) == rounds:
            raise KeyboardInterrupt
        original(task, rnd)
        done.append(rnd)

    exp._run_round = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        exp.run()
    return Experiment.from_run_dir(run_dir, show_progress=False).run(resume=True)


@pytest.fixture
def assets_dir() -> Path:
    """The shared real assets (CIFAR-100, the distilled ViT-Tiny); tests using it skip when it is absent."""
    env = os.environ.get("PROMPTFCL_ASSETS")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "assets")
    for p in candidates:
        if (p / "cifar-100-python" / "train").is_file():
            return p
    pytest.skip("shared assets not found: set PROMPTFCL_ASSETS to the folder holding cifar-100-python/ and models/")


@pytest.fixture(autouse=True, scope="session")
def _image_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Decoded-image caches of file-based test trees go to a session folder, never to a real cache."""
    os.environ["PROMPTFCL_CACHE"] = str(tmp_path_factory.mktemp("image_cache"))
