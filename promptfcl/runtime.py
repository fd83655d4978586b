"""What every side of a federation builds from a config: data, scenario, backbone, method programs.

The in-process experiment builds one `Runtime` for the server loop and its simulated clients; the Flower
ServerApp and each ClientApp build their own from the same config, so both engines run identical objects.
Every check here runs before any training and turns problems into `ConfigError`s that say how to fix them.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from promptfcl.backbones.precision import compile_problem, precision_problem
from promptfcl.backbones.vit import BackboneError, build_vit
from promptfcl.checkpoint import load_checkpoint
from promptfcl.config import (
    ConfigError,
    ExperimentConfig,
    format_validation_error,
    load_config,
    require_variables,
)
from promptfcl.data import DATASETS, DataMissingError, ImageDataset, ImageTransform, resolve_root, subsample_per_class
from promptfcl.data.cache import CacheError, default_cache_dir, materialize
from promptfcl.data.loader import set_nograd_batch
from promptfcl.evaluation.regimes import check_regime
from promptfcl.federation.protocol import ClientProgram, MethodEnv, MethodSpec, ServerProgram
from promptfcl.methods import METHODS
from promptfcl.registry import UnknownNameError
from promptfcl.report.tracking import check_tracking
from promptfcl.scenario.build import build_scenario
from promptfcl.scenario.common import class_order, client_slots, task_class_counts
from promptfcl.scenario.partition import PartitionError
from promptfcl.scenario.personalized import personalized_class_count
from promptfcl.scenario.scenario import Scenario
from promptfcl.scenario.upper_bound import check_upper_bound
from promptfcl.seeding import numpy_rng

_BACKBONES: dict[str, Any] = {}


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
    if spec.scenario_kinds is not None and cfg.scenario.kind not in spec.scenario_kinds:
        kinds = " or ".join(spec.scenario_kinds)
        raise ConfigError(
            f"method {spec.name!r} is defined on scenario.kind {kinds}, not {cfg.scenario.kind!r}; set "
            f"scenario.kind: {spec.scenario_kinds[0]} (see configs/cpu/ for a preset) or choose another method"
        )
    return spec, _validate_section(
        spec.params, cfg.method.params_dict(), "method.", f"hyper-parameters for method {spec.name!r}"
    )


def resolve_dataset_options(cfg: ExperimentConfig) -> tuple[Any, Any]:
    """The registered dataset and its validated options."""
    spec = _lookup(DATASETS, cfg.data.name, "data.name")
    return spec, _validate_section(spec.options, cfg.data.options, "data.options.", "dataset options")


def check_config(cfg: ExperimentConfig) -> None:
    """Cheap checks that need the registries and the file system; run before anything is decoded."""
    problems = []
    for check in (
        resolve_method,
        _check_data,
        _check_backbone,
        _check_eval,
        _check_engine,
        check_upper_bound,
        check_tracking,
    ):
        try:
            check(cfg)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))


def _check_data(cfg: ExperimentConfig) -> None:
    spec, options = resolve_dataset_options(cfg)
    if spec.needs_root:  # an unset $VARIABLE in a path is reported as such, not as a missing folder
        require_variables("data.root", cfg.data.root)
        if cfg.data.cache:
            require_variables("data.cache_dir", cfg.data.cache_dir)
    if spec.needs_root and not cfg.data.download:
        try:
            spec.check(resolve_root(spec, cfg.data.root), options)
        except DataMissingError as e:
            raise ConfigError(f"data: {e}") from None
    try:
        n = spec.num_classes(options)
    except ValueError as e:
        raise ConfigError(f"data.options: {e}") from None
    sc = cfg.scenario
    if sc.kind == "long_tailed" and sc.long_tail.profile == "dataset" and not spec.own_long_tail:
        own = ", ".join(name for name, s in DATASETS.items() if s.own_long_tail)
        raise ConfigError(
            f"scenario.long_tail.profile: dataset keeps the training split's own class counts, but {spec.name}'s "
            f"training split is not long-tailed; use profile: exponential (the default) to subsample it to an "
            f"imbalance factor, or a long-tailed release ({own})"
        )
    try:
        if cfg.scenario.kind == "personalized":  # per-client task sequences: only the classes used count
            counts = [personalized_class_count(cfg.scenario, n)]
        else:
            counts = task_class_counts(cfg.scenario, n)
        order = class_order(cfg.scenario, n, cfg.seed)
    except PartitionError as e:
        raise ConfigError(f"scenario: {e}") from None
    if cfg.scenario.kind != "asynchronous" and len(order) < sum(counts):  # asynchronous tasks reuse classes
        raise ConfigError(
            f"scenario.class_order lists {len(order)} classes but the tasks need {sum(counts)}; list more classes "
            "or lower scenario.num_tasks / scenario.classes_per_task"
        )


def _check_eval(cfg: ExperimentConfig) -> None:
    e = cfg.eval
    check_regime(e.regime, cfg.scenario.kind)
    if e.direct_reference and not (Path(e.direct_reference) / "metrics.json").is_file():
        raise ConfigError(
            f"eval.direct_reference: {e.direct_reference} holds no finished run (no metrics.json); run the direct "
            "reference first (same config with --set method.name=codap_direct) or drop the key"
        )


def _check_engine(cfg: ExperimentConfig) -> None:
    """The fault plan and the quorum must fit the scenario; the precision and compilation must run on the device;
    `engine.kind: flower-sim` needs Flower installed."""
    sc, problems = cfg.scenario, []
    clients = client_slots(sc)
    for i, f in enumerate(cfg.engine.faults):
        key = f"engine.faults.{i}"
        if f.client is not None and f.client >= clients:
            problems.append(f"{key}.client: client {f.client} does not exist; use an id below {clients}")
        if f.tasks and max(f.tasks) >= sc.num_tasks:
            problems.append(f"{key}.tasks: the scenario has tasks 0..{sc.num_tasks - 1}; remove {max(f.tasks)}")
        if f.rounds and max(f.rounds) >= sc.rounds_per_task:
            problems.append(f"{key}.rounds: a task has rounds 0..{sc.rounds_per_task - 1}; remove {max(f.rounds)}")
    if cfg.engine.kind == "flower-sim" and not flower_installed():
        problems.append(
            "engine.kind: flower-sim runs the experiment on Flower's simulation runtime, but flwr is not installed; "
            "pip install 'promptfcl[flower]', or set engine.kind: inprocess (drop --engine flower-sim)"
        )
    device = resolve_device(cfg) if cfg.engine.device != "cuda" or torch.cuda.is_available() else None
    if device is not None:  # (a missing GPU is reported when the device is resolved)
        problems += [p for p in (precision_problem(cfg.engine.precision, device),) if p]
        problems += [p for p in (compile_problem(device) if cfg.engine.compile else None,) if p]
    if problems:
        raise ConfigError("invalid engine section:\n  " + "\n  ".join(problems))


def flower_installed() -> bool:
    """Whether Flower (`flwr`, the `promptfcl[flower]` extra) can be imported; nothing is imported here."""
    return importlib.util.find_spec("flwr") is not None


def _check_backbone(cfg: ExperimentConfig) -> None:
    b = cfg.backbone
    require_variables("backbone.weights", b.weights)
    if b.kind == "clip":
        _check_clip_backbone(cfg)
        return
    import timm

    if not timm.is_model(b.name):
        raise ConfigError(
            f"backbone.name: timm has no model {b.name!r} (try vit_tiny_patch16_224, "
            "vit_base_patch16_224.augreg_in21k; `promptfcl list` shows more)"
        )
    if not b.name.startswith(("vit_", "deit_")):
        raise ConfigError(
            f"backbone.name: {b.name!r} is not a plain ViT; prompt injection needs a timm "
            "VisionTransformer (vit_* or deit_*)"
        )
    if b.weights and not Path(b.weights).is_file():
        raise ConfigError(
            f"backbone.weights: file {b.weights!r} not found; give the path of a .safetensors or "
            "weights-only torch checkpoint, or remove the key to use random init"
        )


def _check_clip_backbone(cfg: ExperimentConfig) -> None:
    from promptfcl.backbones.clip import clip_model_config

    try:
        clip_model_config(cfg.backbone)
    except BackboneError as e:
        raise ConfigError(f"backbone: {e}") from None
    w = cfg.backbone.weights
    if w and not Path(w).is_file():
        raise ConfigError(
            f"backbone.weights: file {w!r} not found; give the path of an open_clip .safetensors (e.g. "
            "open_clip_model.safetensors of timm/vit_base_patch16_clip_224.openai) or weights-only torch checkpoint"
        )


def load_dataset(cfg: ExperimentConfig) -> ImageDataset:
    """The configured dataset, subsampled (`data.train_per_class` / `test_per_class`) before anything is decoded;
    file-based splits are then decoded once into the image cache (`promptfcl.data.cache`) and mapped from it."""
    d = cfg.data
    spec, options = resolve_dataset_options(cfg)
    ds = spec.load(resolve_root(spec, d.root), options, d.download)
    rng = numpy_rng(cfg.seed, "subsample")
    train = subsample_per_class(ds.train, d.train_per_class, rng)
    test = subsample_per_class(ds.test, d.test_per_class, rng)
    ds.train = materialize(train, spec.name, "train", image_cache_dir(cfg), d.decode_workers)
    ds.test = materialize(test, spec.name, "test", image_cache_dir(cfg), d.decode_workers)
    return ds


def image_cache_dir(cfg: ExperimentConfig) -> Path | None:
    """Where decoded images of file-based datasets are cached (`data.cache_dir`, else the default); None when
    `data.cache: false` (decode into RAM). For `promptfcl.data.cache.materialize`."""
    d = cfg.data
    if not d.cache:
        return None
    return Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()


def shared_backbone(cfg: ExperimentConfig, device: torch.device) -> Any:
    """One frozen backbone per (config, device, precision, compile) in this process, shared by every client and
    every run."""
    e = cfg.engine
    key = json.dumps([cfg.backbone.model_dump(mode="json"), str(device), e.precision, e.compile], sort_keys=True)
    if key not in _BACKBONES:
        if cfg.backbone.kind == "clip":
            from promptfcl.backbones.clip import build_clip

            backbone = build_clip(cfg.backbone).to(device)
        else:
            backbone = build_vit(cfg.backbone).to(device)
        backbone.configure(e.precision, e.compile)
        _BACKBONES[key] = backbone
    return _BACKBONES[key]


def resolve_device(cfg: ExperimentConfig) -> torch.device:
    if cfg.engine.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.engine.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device: cuda requested but no GPU is available; use auto or cpu")
    return torch.device(cfg.engine.device)


def run_scenario(cfg: ExperimentConfig, dataset: ImageDataset, scenario_file: Path | None = None) -> Scenario:
    """The run's scenario: reloaded from `scenario_file` (a run's scenario.json) when it exists, else built from
    the config, the dataset's labels and the seed."""
    if scenario_file is not None and scenario_file.is_file():
        return Scenario.load(scenario_file)
    try:
        return build_scenario(
            cfg.scenario, dataset.train.targets.numpy(), dataset.test.targets.numpy(), dataset.num_classes, cfg.seed
        )
    except PartitionError as e:
        raise ConfigError(f"scenario: {e}") from None


def eval_transform(cfg: ExperimentConfig) -> ImageTransform:
    """The evaluation transform of the configured backbone (`MethodEnv.eval_transform`): resize to its input size,
    normalise."""
    b = cfg.backbone
    return ImageTransform(b.img_size, b.mean, b.std, b.interpolation)


@dataclass
class Runtime:
    """A validated config turned into live objects: dataset, scenario, shared backbone, method and its env."""

    cfg: ExperimentConfig
    spec: MethodSpec
    params: Any
    device: torch.device
    dataset: ImageDataset
    scenario: Scenario
    env: MethodEnv

    @classmethod
    def build(cls, cfg: ExperimentConfig, scenario_file: Path | None = None) -> Runtime:
        """Check the config, decode the data, build (or reload) the scenario, share the backbone."""
        check_config(cfg)
        spec, params = resolve_method(cfg)
        device = resolve_device(cfg)
        if cfg.engine.threads:
            torch.set_num_threads(cfg.engine.threads)
        set_nograd_batch(cfg.engine.nograd_batch)  # this process's no-grad passes (default: per device)
        try:
            dataset = load_dataset(cfg)
        except (DataMissingError, CacheError) as e:
            raise ConfigError(f"data: {e}") from None
        scenario = run_scenario(cfg, dataset, scenario_file)
        try:
            backbone = shared_backbone(cfg, device)
        except BackboneError as e:
            raise ConfigError(f"backbone: {e}") from None
        backbone.enable_query_cache(False)  # every run starts with an empty cache; pool methods opt in
        eval_tf = eval_transform(cfg)
        # class names in logit order (CLIP methods build class texts from them); per task, since a real class may
        # own several logits (asynchronous scenarios)
        names = [""] * scenario.label_space.num_logits
        for t in scenario.label_space.tasks:
            for c, j in zip(t.classes, t.logits, strict=True):
                names[j] = dataset.class_names[c]
        env = MethodEnv(
            backbone, scenario.label_space, eval_tf, device, cfg.training_seed(), schedule=scenario.schedule,
            class_names=names, num_clients=scenario.num_clients, rounds_per_task=scenario.rounds_per_task,
        )  # fmt: skip
        if scenario.personalized:  # clients hold only train-split images: the test split is data no client holds
            env.server_split = dataset.test
            env.client_tasks = scenario.client_tasks
        return cls(cfg, spec, params, device, dataset, scenario, env)

    def programs(self) -> tuple[ServerProgram, ClientProgram]:
        """Fresh server and client programs of the configured method."""
        try:
            return self.spec.programs(self.env, self.params)
        except ValueError as e:
            raise ConfigError(f"method: {e}") from None

    @classmethod
    def restore_server(cls, run_dir: Path) -> tuple[Runtime, ServerProgram]:
        """A finished (or interrupted) run's runtime and its server at the last checkpoint, for diagnostics that
        inspect trained models (the global RNG is left as it is)."""
        rt = cls.build(load_config(Path(run_dir) / "config.yaml"), Path(run_dir) / "scenario.json")
        server, _ = rt.programs()
        server.load_state(load_checkpoint(Path(run_dir), restore_rng=False).server)
        return rt, server
