"""The experiment runner: builds data, scenario, backbone and method from a config, then drives
tasks × rounds through the server program, evaluating, logging and checkpointing as it goes.

This is the engine-neutral server loop: it only talks to a `ServerProgram` and a `Grid`.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.table import Table

from promptfcl import __version__
from promptfcl.backbones.vit import BackboneError, FrozenViT, build_vit
from promptfcl.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from promptfcl.config import ConfigError, ExperimentConfig, dump_config, format_validation_error, load_config
from promptfcl.data import (
    DATASETS,
    DataMissingError,
    ImageDataset,
    ImageTransform,
    resolve_root,
    subsample_per_class,
)
from promptfcl.evaluation.evaluator import Evaluator
from promptfcl.evaluation.metrics import accuracy_curve, summarize
from promptfcl.federation.inprocess import InProcessGrid
from promptfcl.federation.message import Message
from promptfcl.federation.protocol import MethodEnv, MethodSpec, RoundInfo
from promptfcl.methods import METHODS
from promptfcl.registry import UnknownNameError
from promptfcl.report.plots import plot_client_class_counts
from promptfcl.report.progress import RunProgress
from promptfcl.report.results import clean_json, summary_rows, write_final, write_rounds
from promptfcl.scenario.partition import PartitionError
from promptfcl.scenario.scenario import Scenario, build_class_incremental
from promptfcl.seeding import numpy_rng

_BACKBONES: dict[str, FrozenViT] = {}


def _lookup(registry: Any, name: str, key: str) -> Any:
    try:
        return registry.get(name)
    except UnknownNameError as e:
        raise ConfigError(f"{key}: {e}") from None


def _validate_section(model: type[BaseModel], values: dict[str, Any], prefix: str, what: str) -> Any:
    try:
        return model.model_validate(values)
    except ValidationError as err:
        lines = format_validation_error(err, model, prefix=prefix)
        raise ConfigError(f"invalid {what}:\n  " + "\n  ".join(lines)) from None


def resolve_method(cfg: ExperimentConfig) -> tuple[MethodSpec, Any]:
    """The registered method and its validated hyper-parameters (paper defaults + config overrides)."""
    spec = _lookup(METHODS, cfg.method.name, "method.name")
    return spec, _validate_section(spec.params, cfg.method.params_dict(), "method.",
                                   f"hyper-parameters for method {spec.name!r}")


def resolve_dataset_options(cfg: ExperimentConfig) -> tuple[Any, Any]:
    """The registered dataset and its validated options."""
    spec = _lookup(DATASETS, cfg.data.name, "data.name")
    return spec, _validate_section(spec.options, cfg.data.options, "data.options.", "dataset options")


def check_config(cfg: ExperimentConfig) -> None:
    """Cheap checks that need the registries and the file system; run before anything is decoded."""
    problems = []
    for check in (resolve_method, _check_data, _check_backbone):
        try:
            check(cfg)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))


def _check_data(cfg: ExperimentConfig) -> None:
    spec, options = resolve_dataset_options(cfg)
    if spec.needs_root and not cfg.data.download:
        try:
            spec.check(resolve_root(spec, cfg.data.root), options)
        except DataMissingError as e:
            raise ConfigError(f"data: {e}") from None
    try:
        n = spec.num_classes(options)
    except ValueError as e:
        raise ConfigError(f"data.options: {e}") from None
    from promptfcl.scenario.scenario import task_class_counts

    try:
        task_class_counts(cfg.scenario, n)
    except PartitionError as e:
        raise ConfigError(f"scenario: {e}") from None


def _check_backbone(cfg: ExperimentConfig) -> None:
    import timm

    b = cfg.backbone
    if not timm.is_model(b.name):
        raise ConfigError(f"backbone.name: timm has no model {b.name!r} (try vit_tiny_patch16_224, "
                          "vit_base_patch16_224.augreg_in21k; `promptfcl list` shows more)")
    if not b.name.startswith(("vit_", "deit_")):
        raise ConfigError(f"backbone.name: {b.name!r} is not a plain ViT; prompt injection needs a timm "
                          "VisionTransformer (vit_* or deit_*)")
    if b.weights and not Path(b.weights).is_file():
        raise ConfigError(f"backbone.weights: file {b.weights!r} not found; give the path of a .safetensors or "
                          "weights-only torch checkpoint, or remove the key to use random init")


def load_dataset(cfg: ExperimentConfig) -> ImageDataset:
    spec, options = resolve_dataset_options(cfg)
    ds = spec.load(resolve_root(spec, cfg.data.root), options, cfg.data.download)
    rng = numpy_rng(cfg.seed, "subsample")
    ds.train = subsample_per_class(ds.train, cfg.data.train_per_class, rng)
    ds.test = subsample_per_class(ds.test, cfg.data.test_per_class, rng)
    return ds


def shared_backbone(cfg: ExperimentConfig, device: torch.device) -> FrozenViT:
    """One frozen backbone per (config, device) in this process, shared by every client and every run."""
    key = json.dumps([cfg.backbone.model_dump(mode="json"), str(device)], sort_keys=True)
    if key not in _BACKBONES:
        _BACKBONES[key] = build_vit(cfg.backbone).to(device)
    return _BACKBONES[key]


def resolve_device(cfg: ExperimentConfig) -> torch.device:
    if cfg.engine.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.engine.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device: cuda requested but no GPU is available; use auto or cpu")
    return torch.device(cfg.engine.device)


def environment_info() -> dict[str, str]:
    import timm

    return {"promptfcl": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "timm": timm.__version__, "numpy": np.__version__, "platform": platform.platform()}


class Experiment:
    """One run of one method on one scenario; `run()` trains, evaluates and writes `run_dir`."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, show_progress: bool = True,
                 console: Console | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.show_progress = show_progress
        self.console = console or Console()

    @classmethod
    def from_run_dir(cls, run_dir: Path, **kwargs: Any) -> Experiment:
        cfg_path = Path(run_dir) / "config.yaml"
        if not cfg_path.is_file():
            raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); nothing to resume")
        return cls(load_config(cfg_path), Path(run_dir), **kwargs)

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, resume: bool) -> None:
        t0 = time.perf_counter()
        cfg = self.cfg
        check_config(cfg)
        self.spec, self.params = resolve_method(cfg)
        self.device = resolve_device(cfg)
        if cfg.engine.threads:
            torch.set_num_threads(cfg.engine.threads)
        try:
            self.dataset = load_dataset(cfg)
        except DataMissingError as e:
            raise ConfigError(f"data: {e}") from None
        scenario_path = self.run_dir / "scenario.json"
        if resume and scenario_path.is_file():
            self.scenario = Scenario.load(scenario_path)
        else:
            try:
                self.scenario = build_class_incremental(cfg.scenario, self.dataset.train.targets.numpy(),
                                                        self.dataset.test.targets.numpy(),
                                                        self.dataset.num_classes, cfg.seed)
            except PartitionError as e:
                raise ConfigError(f"scenario: {e}") from None
        try:
            backbone = shared_backbone(cfg, self.device)
        except BackboneError as e:
            raise ConfigError(f"backbone: {e}") from None
        b = cfg.backbone
        eval_tf = ImageTransform(b.img_size, b.mean, b.std, b.interpolation)
        self.env = MethodEnv(backbone, self.scenario.label_space, eval_tf, self.device, cfg.seed)
        try:
            self.server, self.client = self.spec.programs(self.env, self.params)
        except ValueError as e:
            raise ConfigError(f"method: {e}") from None
        self.grid = InProcessGrid(self.client, self.scenario, self.dataset.train, cfg.seed, self.device,
                                  on_reply=self._on_reply)
        self.evaluator = Evaluator(self.dataset.test, self.scenario, eval_tf, cfg.eval.batch_size, self.device)
        self.setup_seconds = time.perf_counter() - t0

    def _write_run_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        targets = self.dataset.train.targets.numpy()
        self.scenario.save(self.run_dir / "scenario.json", targets)
        plot_client_class_counts(self.scenario.client_class_counts(targets), self.run_dir / "scenario_heatmap.png",
                                 [len(c) for c in self.scenario.task_classes])
        (self.run_dir / "environment.json").write_text(json.dumps(environment_info(), indent=2))

    # ------------------------------------------------------------------------------------------- run
    def run(self, resume: bool = False) -> dict[str, Any]:
        self.setup(resume)
        progress_state: dict[str, Any] = {"accuracy_matrix": [], "correct": [], "total": [], "rounds": [],
                                          "timing": {"client_seconds": 0.0, "server_seconds": 0.0,
                                                     "eval_seconds": 0.0, "train_seconds": 0.0}}
        start_task, start_round = 0, 0
        if resume:
            ckpt = load_checkpoint(self.run_dir)
            self.server.load_state(ckpt.server)
            self.grid.states.update(ckpt.clients)
            progress_state = ckpt.progress
            start_task, start_round = ckpt.next_task, ckpt.next_round
        else:
            self._write_run_files()
        self.state = progress_state
        T, R = self.scenario.num_tasks, self.scenario.rounds_per_task
        with RunProgress(T * R, self.show_progress) as self.progress:
            self.progress.skip(start_task * R + start_round)
            for task in range(start_task, T):
                first = start_round if task == start_task else 0
                if first == 0:
                    self.server.begin_task(task)
                for rnd in range(first, R):
                    self._run_round(task, rnd)
        return self._finish()

    def _on_reply(self, client: int, reply: Message) -> None:
        loss = reply.scalars.get("loss")
        self.progress.client_done(client, loss if isinstance(loss, float) else None)

    def _run_round(self, task: int, rnd: int) -> None:
        T, R = self.scenario.num_tasks, self.scenario.rounds_per_task
        info = RoundInfo(task, rnd, tuple(self.scenario.participants[task][rnd]))
        self.progress.round_started(task, T, rnd, R)
        self.grid.start_round(info)
        t0 = time.perf_counter()
        round_metrics = self.server.run_round(self.grid, info)
        last = rnd == R - 1
        if last:
            self.server.end_task(task)
        round_seconds = time.perf_counter() - t0
        traffic = self.grid.traffic
        timing = self.state["timing"]
        timing["client_seconds"] += traffic.client_seconds
        timing["server_seconds"] += round_seconds - traffic.client_seconds
        entry: dict[str, Any] = {"task": task, "round": rnd, "participants": list(info.participants),
                                 **traffic.as_dict(), "seconds": round(round_seconds, 4),
                                 "failures": [f.__dict__ for f in self.grid.failures], **round_metrics}
        if last or self.cfg.eval.every_round:
            self.progress.note("evaluating")
            t1 = time.perf_counter()
            results = self.evaluator.evaluate(self.server.global_model(), task)
            timing["eval_seconds"] += time.perf_counter() - t1
            entry["accuracy"] = [r.accuracy for r in results]
            if last:
                self.state["accuracy_matrix"].append([r.accuracy for r in results])
                self.state["correct"] = [r.correct for r in results]
                self.state["total"] = [r.total for r in results]
        self.state["rounds"].append(clean_json(entry))
        write_rounds(self.run_dir, self.state["rounds"])
        nxt = (task + 1, 0) if last else (task, rnd + 1)
        save_checkpoint(self.run_dir, Checkpoint(nxt[0], nxt[1], self.server.state(), dict(self.grid.states),
                                                 self.state))
        self.progress.round_done()

    def _finish(self) -> dict[str, Any]:
        A = self.state["accuracy_matrix"]
        rounds = self.state["rounds"]
        timing = dict(self.state["timing"])
        timing["setup_seconds"] = self.setup_seconds
        timing["total_seconds"] = (self.setup_seconds + timing["client_seconds"] + timing["server_seconds"]
                                   + timing["eval_seconds"])
        up = sum(r["bytes_up"] for r in rounds)
        down = sum(r["bytes_down"] for r in rounds)
        metrics = {
            "method": self.spec.name,
            "run": self.cfg.run_name(),
            "seed": self.cfg.seed,
            "summary": summarize(A, self.state["correct"], self.state["total"]),
            "accuracy_matrix": A,
            "accuracy_curve": accuracy_curve(A),
            "communication": {"bytes_up": up, "bytes_down": down, "rounds": len(rounds),
                              "mb_per_round": (up + down) / max(len(rounds), 1) / 1e6},
            "timing": timing,
        }
        write_final(self.run_dir, self.cfg.run_name(), metrics)
        return metrics

    def print_summary(self, metrics: dict[str, Any]) -> None:
        table = Table(title=f"{metrics['run']} ({metrics['method']})")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in summary_rows(metrics):
            table.add_row(k, v)
        self.console.print(table)
        self.console.print(f"results written to {self.run_dir}/")
