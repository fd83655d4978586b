"""Experiment configuration: pydantic models, YAML loading, `--set key=value` overrides, readable errors.

Everything a run needs is validated here, before any data is decoded or any model is built. Errors are
collected into a `ConfigError` whose message names each offending key and says how to fix it.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message lists every problem found."""


_ENV_VARIABLE = re.compile(r"\$(\w+|\{([^}]*)\})", re.ASCII)  # what os.path.expandvars expands


def unset_variables(text: str | None) -> list[str]:
    """The environment variables `text` still names (`$NAME` / `${NAME}`) that are not set: `os.path.expandvars`,
    which config paths go through when they are validated, leaves those in place."""
    names = [m.group(2) if m.group(2) is not None else m.group(1) for m in _ENV_VARIABLE.finditer(text or "")]
    return [n for n in dict.fromkeys(names) if n and n not in os.environ]


def require_variables(key: str, value: str | None) -> None:
    """Raise a `ConfigError` naming every unset environment variable in the path `value` of config key `key`.

    Checked when a config is about to be used (`promptfcl.runtime.check_config`), not when it is loaded, so a
    config can be read, compared and dumped on a machine without its assets."""
    missing = unset_variables(value)
    if missing:
        raise ConfigError(
            "\n".join(
                f"environment variable {n} is not set ({key}: {value}); export "
                f"{n}=/path/to/{n.removeprefix('PROMPTFCL_').lower() or 'folder'}"
                for n in missing
            )
        )


class StrictModel(BaseModel):
    """Base for config sections: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(StrictModel):
    """Which dataset, where it lives, and how to subsample it (for CPU-scale runs)."""

    name: str = "synthetic"
    root: str | None = Field(None, description="dataset folder; defaults to $PROMPTFCL_DATA/<name>")
    download: bool = Field(False, description="allow torchvision to download (needs internet)")
    train_per_class: int | None = Field(None, gt=0, description="keep this many train images per class")
    test_per_class: int | None = Field(None, gt=0, description="keep this many test images per class")
    options: dict[str, Any] = Field(default_factory=dict, description="dataset-specific options")
    cache: bool = Field(
        True,
        description="file-based datasets: decode the kept images once into a memory-mapped uint8 file under "
        "cache_dir (N·3·S² bytes, reused by later runs); false: decode into RAM at every run",
    )
    cache_dir: str | None = Field(
        None, description="image cache folder; default $PROMPTFCL_CACHE, else ~/.cache/promptfcl"
    )
    decode_workers: int | None = Field(None, gt=0, description="threads decoding images; default: CPUs, at most 8")

    @field_validator("root", "cache_dir")
    @classmethod
    def _expand_root(cls, v: str | None) -> str | None:
        return os.path.expandvars(v) if v else v


class PartitionConfig(StrictModel):
    """How each task's training samples are split over clients.

    `dirichlet` / `iid`: a fixed split of every task over `num_clients` clients. `hepco`: every round draws
    `num_clients` new stateless clients, each with a κ fraction of the task's classes, a γ fraction of each kept
    class's images (overlap allowed) and a long-tail profile of ratio `imbalance` (HePCo §5.1). `apply_imbalance`:
    true (the paper: the β profile shapes each client's data) | false (the official code, whose β line is commented
    out: every kept class keeps its γ fraction, so β changes no client's data; the code still reports the β
    profile's counts to its server, which is not reproduced — clients here report the counts of the data they
    hold; at β = 1, the value of every released script, both agree).
    """

    kind: Literal["dirichlet", "iid", "hepco"] = "dirichlet"
    beta: float = Field(0.5, gt=0, description="Dirichlet concentration; smaller = more label skew")
    min_samples: int = Field(6, ge=0, description="redraw a task's split until every client has this many")
    max_retries: int = Field(10000, gt=0)
    category_ratio: float = Field(0.6, gt=0, le=1, description="hepco κ: fraction of the task's classes per client")
    split_ratio: float = Field(0.1, gt=0, le=1, description="hepco γ: fraction of a kept class's images per client")
    imbalance: float = Field(1.0, gt=0, le=1, description="hepco β: tail/head ratio of a client's class counts")
    apply_imbalance: bool = Field(
        True,
        description="hepco: subsample each client's kept classes to the β profile (paper); false: keep γ of every "
        "kept class, β unused (the official code)",
    )


class ParticipationConfig(StrictModel):
    """Which clients take part: a fraction, drawn once per task (fed-mammoth) or every round."""

    fraction: float = Field(1.0, gt=0, le=1)
    mode: Literal["per_task", "per_round"] = "per_task"


class LongTailConfig(StrictModel):
    """`scenario.kind: long_tailed`: the long-tailed training set, then the client partition.

    `profile: exponential` (default): global exponential long-tail subsampling, class c (in class order) keeps
    n_max·IF^(−c/(C−1)) training images (LDAM / CReFF; CIFAR-10/100-LT, Fashion-MNIST-LT). `profile: dataset`:
    the training split keeps its own class counts (ImageNet-LT's 5–1,280 images per class, as CAPT uses it); only
    on datasets whose release is long-tailed (`imagenet_lt`, `image_folder` lists), without `imbalance_factor`
    (`data.train_per_class`, if set, caps every class first and so flattens the head).
    Head / mid / tail classes are those whose cumulative share of the sorted class counts, before them, is below
    `head_share` / below `mid_share` / at least `mid_share` (FedLoGe's 75 % / 95 % thresholds, as CAPT uses).
    """

    profile: Literal["exponential", "dataset"] = Field(
        "exponential", description="exponential: subsample to IF; dataset: keep the training split's own counts"
    )
    imbalance_factor: float = Field(100.0, ge=1, description="IF = n_max / n_min (CAPT: 100, 50, 10)")
    head_share: float = Field(0.75, gt=0, lt=1)
    mid_share: float = Field(0.95, gt=0, lt=1)

    @model_validator(mode="after")
    def _factor_needs_exponential(self) -> LongTailConfig:
        if self.profile == "dataset" and "imbalance_factor" in self.model_fields_set:
            raise ValueError(
                "scenario.long_tail.imbalance_factor shapes the exponential profile; profile: dataset keeps the "
                "training split's own class counts, so drop imbalance_factor (or use profile: exponential)"
            )
        return self


class PersonalizedConfig(StrictModel):
    """Per-client task sequences (FedMGP, Yu et al. KDD'24 §5.1.1), used when `scenario.kind: personalized`.

    `asynchronous`: each client owns `private_classes` classes (all their images); the next `public_classes`
    classes of the class order are shared, each split over clients by Dirichlet(`beta`); a client's classes are
    shuffled into `num_tasks` tasks of equal size. `synchronous`: the class-incremental task split (same order
    for every client), each class's samples split over clients by Dirichlet(`beta`). Each client's data of each
    task is split (1 − `local_test_fraction`) / `local_test_fraction` into local train / local test.
    """

    mode: Literal["asynchronous", "synchronous"] = "asynchronous"
    private_classes: int = Field(15, ge=0, description="asynchronous: classes only one client holds")
    public_classes: int = Field(25, ge=0, description="asynchronous: classes split over every client")
    beta: float = Field(1.0, gt=0, description="Dirichlet concentration of the sample split")
    local_test_fraction: float = Field(0.3, gt=0, lt=1, description="share of each client-task set held out")


class AsynchronousConfig(StrictModel):
    """Powder / C2Prompt's asynchronous task switching (`scenario.kind: asynchronous`).

    Every client has its own sequence of `num_tasks` tasks of `classes_per_task` real classes; task j > 0 (in
    client-major order) reuses a uniform number s ∈ [min_overlap, classes_per_task] of the classes of a random
    earlier task (of any client), the rest drawn fresh. Each (client, task) owns its own logit slots. The run has
    `num_tasks` stages of `rounds_per_task` rounds; at each stage boundary s a random `switching_clients` clients
    jump to task s of their own sequence (skipping tasks), the others keep their current task. Each task uses one
    of `data_slices` disjoint slices of a fixed seeded permutation of every class's training images; `slice_rule`
    picks which:

    - `powder` (default, Powder's code `fl_main_hard.py`): slice (k·T + j) mod `data_slices` for client k's task j.
      When T is a multiple of `data_slices` (Powder's ImageNet-R: T = 5 tasks, 5 slices) this is slice j for every
      client, so a class that recurs at the same position j of two clients' sequences is trained on the *same*
      images; repeats at different positions see different images. (Powder's DomainNet uses K·T = 50 slices of
      2 %: every (client, task) its own slice.)
    - `distinct`: the r-th occurrence of a class (tasks in client-major order k·T + j) uses slice r mod
      `data_slices`, so every repeat of a class sees different images, as long as a class occurs at most
      `data_slices` times (further repeats cycle, possibly onto a slice another client trained on).
    - `disjoint`: no image is trained on by two clients: each client using a class is reserved a slice of its own,
      the class's spare slices go to repeats (as in `distinct`), after which a repeat reuses the client's own
      slices (needs `data_slices` ≥ the clients using a class; `data_slices` ≥ `num_clients` always suffices).
    """

    switching_clients: int | None = Field(None, ge=0, description="clients that switch per stage; default ⌊K/2⌋")
    min_overlap: int = Field(0, ge=0, description="Powder's `sim`: least classes reused from an earlier task")
    data_slices: int = Field(5, gt=0, description="each task uses 1/data_slices of every class's images")
    slice_rule: Literal["powder", "distinct", "disjoint"] = Field(
        "powder",
        description="powder: slice (k·T + j) mod data_slices (Powder's code); distinct: every repeat of a class "
        "gets the next slice, so repeats see different images; disjoint: every client its own slices of a class "
        "(spare ones to repeats), so no two clients share an image",
    )


DOMAIN_STEPS = ("colour", "blur", "noise")
# `clients: mixed`: client k gets entry k mod 7 — every client a different kind of shift for up to 7 clients (and
# always different parameters)
MIXED_DOMAINS = ("colour", "blur", "noise", "colour+blur", "colour+noise", "blur+noise", "colour+blur+noise")


def client_domain_steps(clients: str | list[str], num_clients: int) -> list[tuple[str, ...]]:
    """[client] → its domain's steps (`()`: none) from `scenario.domains.clients` (a preset name or a list)."""
    names = [MIXED_DOMAINS[k % len(MIXED_DOMAINS)] for k in range(num_clients)] if clients == "mixed" else clients
    return [() if n == "none" else tuple(n.split("+")) for n in names]


class DomainsConfig(StrictModel):
    """Per-client image domains (`scenario.domains`, asynchronous scenarios; `promptfcl.data.domains`): every image
    a client trains on, and the test images of its own (client, task) evaluations, pass through the client's fixed
    transform, so a class's features differ between clients (the cross-client gap C2Prompt's LCDC compensates).

    `clients`: one entry per client — `none` or steps joined by `+` from `colour` (hue rotation about the grey
    axis), `blur` (Gaussian), `noise` (additive Gaussian, a fixed function of the image and client) — or `mixed`
    (client k: colour, blur, noise, colour+blur, colour+noise, blur+noise, colour+blur+noise, cycling). Each
    client's parameters are drawn uniformly in the ranges below from (seed, client id) and saved in scenario.json.
    """

    clients: Literal["mixed"] | list[str] = Field(
        ..., description="mixed, or one domain per client: none | colour | blur | noise | steps joined by +"
    )
    hue_degrees: tuple[float, float] = Field((60.0, 300.0), description="colour: hue rotation range (degrees)")
    blur_sigma: tuple[float, float] = Field((0.02, 0.035), description="blur: σ range, as a fraction of the side")
    noise_std: tuple[float, float] = Field((0.06, 0.12), description="noise: std range, as a fraction of 255")

    @field_validator("clients")
    @classmethod
    def _known_steps(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str):
            return v
        for entry in v:
            steps = entry.split("+")
            bad = [s for s in steps if s not in DOMAIN_STEPS]
            if entry != "none" and (bad or len(set(steps)) != len(steps)):
                hint = difflib.get_close_matches(bad[0], DOMAIN_STEPS, 1) if bad else []
                raise ValueError(
                    f"unknown client domain {entry!r}: use none, or steps joined by + from {', '.join(DOMAIN_STEPS)}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                )
        return v

    @field_validator("hue_degrees", "blur_sigma", "noise_std")
    @classmethod
    def _ordered_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 <= v[0] <= v[1]:
            raise ValueError(f"give a range [low, high] with 0 ≤ low ≤ high, got {list(v)}")
        return v

    @model_validator(mode="after")
    def _sensible_strengths(self) -> DomainsConfig:
        if self.hue_degrees[1] > 360:
            raise ValueError("hue_degrees: a hue rotation lies in [0, 360] degrees")
        if self.blur_sigma[0] <= 0 or self.blur_sigma[1] > 0.5:
            raise ValueError("blur_sigma: σ is a fraction of the image side in (0, 0.5]; e.g. [0.02, 0.035]")
        if self.noise_std[0] <= 0 or self.noise_std[1] > 1:
            raise ValueError("noise_std: a fraction of the 0–255 range in (0, 1]; e.g. [0.06, 0.12]")
        return self


# the scenario sections that mean something under one `scenario.kind` only (`scenario.domains`, None by default,
# has its own check, `ScenarioConfig._domains_fit`)
KIND_SECTIONS = {"long_tail": "long_tailed", "personalized": "personalized", "asynchronous": "asynchronous"}


def non_default_keys(section: BaseModel) -> list[str]:
    """`key=value` for every field of a config section that differs from the section's defaults."""
    now, default = section.model_dump(mode="json"), type(section)().model_dump(mode="json")
    return [f"{k}={now[k]}" for k in now if now[k] != default.get(k)]


class ScenarioConfig(StrictModel):
    """A federated scenario: class-incremental tasks, one static long-tailed task (`kind: long_tailed`),
    Powder/C2Prompt's per-client task sequences with asynchronous switching (`kind: asynchronous`, see
    `AsynchronousConfig`; `num_tasks` is both the number of stages and each client's sequence length,
    `classes_per_task` one int, the partition is not used), or FedMGP's per-client task sequences with local test
    splits (`kind: personalized`, see `PersonalizedConfig`). Builders are dispatched in
    `promptfcl.scenario.build.build_scenario`. `domains` (asynchronous only) gives every client a fixed image
    transform of its own (`DomainsConfig`). `long_tail`, `asynchronous`, `personalized` and `domains` belong to
    their kind: set away from their defaults under another kind they are refused (left at their defaults, as every
    run's dumped `config.yaml` writes them, they are accepted)."""

    kind: Literal["class_incremental", "long_tailed", "asynchronous", "personalized"] = "class_incremental"
    num_tasks: int = Field(10, gt=0)
    classes_per_task: int | list[int] | None = Field(
        None, description="classes in each task; default: all classes split evenly over num_tasks"
    )
    class_order: Literal["natural", "shuffled"] | list[int] = "natural"
    num_clients: int = Field(10, gt=0)
    rounds_per_task: int = Field(5, gt=0)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    participation: ParticipationConfig = Field(default_factory=ParticipationConfig)
    asynchronous: AsynchronousConfig = Field(default_factory=AsynchronousConfig, description="kind: asynchronous")
    personalized: PersonalizedConfig = Field(default_factory=PersonalizedConfig, description="kind: personalized")
    long_tail: LongTailConfig = Field(default_factory=LongTailConfig, description="kind: long_tailed")
    domains: DomainsConfig | None = Field(
        None, description="per-client image domains (asynchronous scenarios): each client's images are transformed"
    )
    upper_bound: Literal["centralized", "joint"] | None = Field(
        None,
        description="an upper-bound row instead of the federation (promptfcl.scenario.upper_bound): centralized = "
        "one learner holding every client's data, task by task; joint = one learner, one task of all classes",
    )

    @model_validator(mode="after")
    def _sections_fit_kind(self) -> ScenarioConfig:
        """A kind-specific section (`KIND_SECTIONS`) set away from its defaults under another kind would be
        silently ignored: refuse it. Left at its defaults (as every dumped `config.yaml` writes it) it is fine."""
        for section, kind in KIND_SECTIONS.items():
            changed = non_default_keys(getattr(self, section))
            if self.kind != kind and changed:
                also = " (and num_tasks: 1)" if kind == "long_tailed" else ""
                raise ValueError(
                    f"scenario.{section} applies to scenario.kind: {kind}, not {self.kind}; set scenario.kind: "
                    f"{kind}{also} or drop scenario.{section} (it sets {', '.join(changed)})"
                )
        return self

    @model_validator(mode="after")
    def _upper_bound_is_defined(self) -> ScenarioConfig:
        if self.upper_bound is not None and self.kind in ("asynchronous", "personalized"):
            raise ValueError(
                f"scenario.upper_bound: {self.upper_bound} is defined on class_incremental and long_tailed scenarios "
                f"(one shared task sequence), not on {self.kind} ones (per-client task sequences); drop "
                "scenario.upper_bound or set scenario.kind: class_incremental"
            )
        return self

    @model_validator(mode="after")
    def _domains_fit(self) -> ScenarioConfig:
        d = self.domains
        if d is None:
            return self
        if self.kind != "asynchronous":
            raise ValueError(
                f"scenario.domains: per-client domains are defined on asynchronous scenarios (each (client, task) is "
                f"tested on its own, in its client's domain), not on {self.kind} ones (one shared test set); set "
                "scenario.kind: asynchronous or drop scenario.domains"
            )
        if isinstance(d.clients, list) and len(d.clients) != self.num_clients:
            raise ValueError(
                f"scenario.domains.clients lists {len(d.clients)} domains but num_clients is {self.num_clients}; "
                "give one domain per client (none for an unchanged client) or use clients: mixed"
            )
        return self

    @model_validator(mode="after")
    def _long_tail_is_static(self) -> ScenarioConfig:
        if self.kind == "long_tailed" and self.num_tasks != 1:
            raise ValueError("a long_tailed scenario is one static task: set scenario.num_tasks: 1")
        if self.long_tail.mid_share <= self.long_tail.head_share:
            raise ValueError("scenario.long_tail.mid_share must exceed head_share")
        return self

    @field_validator("classes_per_task")
    @classmethod
    def _positive_counts(cls, v: int | list[int] | None) -> int | list[int] | None:
        counts = [v] if isinstance(v, int) else (v or [])
        if any(c <= 0 for c in counts):
            raise ValueError("every task needs at least one class")
        return v


class BackboneConfig(StrictModel):
    """The frozen backbone: a timm ViT (default) or an open_clip CLIP (`kind: clip`, the `promptfcl[clip]` extra),
    where its weights come from, and its input convention."""

    kind: Literal["timm", "clip"] = Field("timm", description="timm ViT, or open_clip CLIP (image + text towers)")
    name: str = "vit_tiny_patch16_224"
    img_size: int = Field(224, gt=0)
    pretrained: bool = Field(False, description="download weights from the hub (needs internet)")
    tag: str = Field("openai", description="clip only: the open_clip pretrained tag used when pretrained is true")
    weights: str | None = Field(None, description="local .safetensors or weights_only torch checkpoint")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra timm.create_model arguments; clip: overrides deep-merged into open_clip's model config",
    )
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    init_seed: int = Field(0, description="seed of the random init (used as is when no weights are loaded)")
    stem_cache: bool = Field(
        True, description="hybrid backbones (a frozen CNN stem before the ViT): cache the stem's output per image"
    )
    stem_cache_mb: float = Field(4096, gt=0, description="memory the stem cache may fill (float32 token maps)")
    stem_channels_last: bool = Field(
        True,
        description="hybrid backbones: run the frozen CNN stem in channels-last memory format (about 1.3x faster on "
        "CPU; its output differs from the default layout's at float rounding, about 1e-5)",
    )

    @field_validator("weights")
    @classmethod
    def _expand_weights(cls, v: str | None) -> str | None:
        return os.path.expandvars(v) if v else v


Precision = Literal["fp32", "bf16", "fp16"]
FaultKind = Literal["raise", "slow", "nonfinite", "bad_schema", "no_reply"]


class FaultSpec(StrictModel):
    """One entry of a fault plan: which client misbehaves how, in which tasks / rounds (for tests and drills).

    Faults are injected at the engine boundary (`promptfcl.federation.faults`), so methods never change:
    `raise` the client program raises; `slow` it sleeps `delay` s first (needs `engine.client_timeout`);
    `nonfinite` its reply carries NaN/inf; `bad_schema` a reply tensor gets the wrong name, shape or dtype;
    `no_reply` the message is lost and the client never answers.
    """

    kind: FaultKind
    client: int | None = Field(
        None, ge=0, description="client id; default: one participant per round, the one at position round mod n"
    )
    tasks: list[int] | None = Field(None, description="tasks in which the fault fires; default: every task")
    rounds: list[int] | None = Field(None, description="rounds (within a task) in which it fires; default: all")
    attempts: int | None = Field(
        1, gt=0, description="fires on the first N attempts of a round (see engine.round_retries); null: on all"
    )
    delay: float | None = Field(None, gt=0, description="slow: seconds to sleep; default client_timeout + 0.25")
    schema_error: Literal["name", "shape", "dtype", "cycle"] = Field(
        "cycle", description="bad_schema: what is wrong; cycle: name, shape, dtype by round"
    )

    @field_validator("tasks", "rounds")
    @classmethod
    def _non_negative(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(x < 0 for x in v):
            raise ValueError("task and round indices start at 0; remove the negative entries")
        return v


EngineKind = Literal["inprocess", "flower-sim"]


class EngineConfig(StrictModel):
    """Where and how clients run, and what a round tolerates (see ARCHITECTURE.md, Reliability).

    `kind` is the engine `promptfcl run` uses (`--engine` overrides it); the run's `config.yaml` records it, so
    `promptfcl run --resume RUN_DIR` and study cells run on the engine their config names."""

    kind: EngineKind = Field(
        "inprocess",
        description="inprocess: the clients run in this process; flower-sim: Flower's simulation runtime, one "
        "virtual SuperNode per client (needs pip install 'promptfcl[flower]')",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, gt=0, description="torch CPU threads; default: torch's choice")
    min_clients: int = Field(
        1, ge=1, description="a round completes if at least this many clients (or all addressed) reply usably"
    )
    round_retries: int = Field(0, ge=0, description="re-run a round that missed min_clients this many times")
    client_timeout: float | None = Field(
        None, gt=0, description="seconds a client may take before its reply is dropped"
    )
    faults: list[FaultSpec] = Field(default_factory=list, description="fault plan injected at the engine boundary")
    tracking: Literal["tensorboard"] | None = Field(
        None,
        description="also log every round's scalars and the final summary for TensorBoard under RUN_DIR/tb/ "
        "(needs the promptfcl[tracking] extra)",
    )
    precision: Precision = Field(
        "fp32",
        description="fp32 | bf16 | fp16: autocast dtype of the frozen backbone's forward and backward (trainable "
        "tensors stay float32; fp16 adds loss scaling; fp16 is refused on the CPU)",
    )
    compile: bool = Field(False, description="torch.compile the backbone's forward (first batches compile)")
    nograd_batch: int | None = Field(
        None,
        gt=0,
        description="batch of every no-grad pass over client or test data (evaluation, class statistics, Grams, "
        "prompt effect); default per device: on the CPU the measured fastest at the torch thread count "
        "(promptfcl.data.loader.CPU_NOGRAD_BATCH, benchmarks/nograd_batch.py), elsewhere each pass's own "
        "(eval.batch_size, 128); values change only at float rounding",
    )

    @model_validator(mode="after")
    def _slow_needs_timeout(self) -> EngineConfig:
        for i, f in enumerate(self.faults):
            if f.kind == "slow" and self.client_timeout is None:
                raise ValueError(
                    f"faults[{i}] is 'slow' but engine.client_timeout is not set; set engine.client_timeout "
                    "(seconds) so the slow client can exceed it"
                )
            if f.kind == "slow" and f.delay is not None and self.client_timeout and f.delay <= self.client_timeout:
                raise ValueError(
                    f"faults[{i}].delay ({f.delay} s) must exceed engine.client_timeout ({self.client_timeout} s)"
                )
        return self


class EvalConfig(StrictModel):
    """When and how the global model is evaluated.

    `regime` (dispatched in `promptfcl.evaluation.regimes.build_regime`): `auto` = task-agnostic for
    class-incremental scenarios, task-aware per (client, task) for asynchronous ones, client_local for personalized
    ones; `task_agnostic` (all seen logits compete); `task_aware` (each task's own logits); `client_local` (FedMGP:
    each client tests its own model on its local test splits, task-aware, with KR_t / KR_s; personalized only).
    `model`: `auto` evaluates each (client, task) with the model the server holds for that client (client-specific
    under C2Prompt's CPA, else the global one); `global` always uses the global model. `direct_reference`: the run
    directory of a `direct` single-task run with the same scenario and seed, for forward transfer.
    """

    every_round: bool = Field(False, description="also evaluate after every round (slower)")
    batch_size: int = Field(256, gt=0)
    class_groups: bool | None = Field(
        None,
        description="report overall/head/mid/tail accuracy (static long-tailed evaluation); "
        "default: whenever the scenario defines class groups (scenario.kind: long_tailed)",
    )
    regime: Literal["auto", "task_agnostic", "task_aware", "client_local"] = "auto"
    model: Literal["auto", "global"] = "auto"
    direct_reference: str | None = Field(None, description="run dir of the direct single-task run (FWT)")
    retention_every_round: bool = Field(
        True, description="client_local: also measure KR_t / KR_s after every round (else only after each task)"
    )


class MethodConfig(BaseModel):
    """`name` picks a registered method; every other key is validated by that method's Params model."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedavg_prompt"

    def params_dict(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ExperimentConfig(StrictModel):
    """One run: data × scenario × backbone × method × engine, with a seed."""

    name: str | None = None
    seed: int = Field(
        0,
        description="seed of the scenario (data subsample, class order, partition) and, unless "
        "train_seed is set, of the training randomness",
    )
    train_seed: int | None = Field(
        None,
        description="seed of the training randomness only (initialisation, client batches and augmentation, server "
        "draws); default: seed. Runs that differ only in train_seed share the scenario, so their spread is the "
        "run-to-run noise of training",
    )
    output_dir: str = "results"
    data: DataConfig = Field(default_factory=DataConfig)
    scenario: ScenarioConfig = Field(default_factory=ScenarioConfig)
    backbone: BackboneConfig = Field(default_factory=BackboneConfig)
    method: MethodConfig = Field(default_factory=MethodConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    def run_name(self) -> str:
        return self.name or f"{self.method.name}_{self.data.name}_seed{self.seed}"

    def training_seed(self) -> int:
        """The seed of the training randomness: `train_seed` when set, else `seed`."""
        return self.seed if self.train_seed is None else self.train_seed


# --------------------------------------------------------------------------------------------- loading


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: `1e-4` is a number (YAML 1.1, PyYAML's default, needs `1.0e-4`
    and reads `1e-4` as a string), so configs, overrides and sweep values all read exponents as numbers."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """YAML text → Python values, with `ConfigLoader` (exponent floats read as numbers)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader subclass


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (["a", "b", "c"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value (e.g. scenario.num_tasks=5)")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return key.strip().split("."), value


def dotted_keys(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping flattened to `section.key` → value (the keys `--set` takes)."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(dotted_keys(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        raw = load_yaml(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (data, scenario, method, …)")
    return raw


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the (sub)model a location points into."""
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return []
    return list(model.model_fields)


def format_validation_error(err: ValidationError, model: type[BaseModel], prefix: str = "") -> list[str]:
    """One readable line per pydantic error: the dotted key, what is wrong, and how to fix it."""
    lines = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not isinstance(x, int) or True)
        path = prefix + ".".join(str(x) for x in loc)
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            lines.append(f"{path}: unknown key; {hint}allowed keys here: {', '.join(allowed)}")
        elif e["type"] == "missing":
            lines.append(f"{path}: required; add it to the config")
        else:
            got = e.get("input")
            got_text = f" (got {got!r})" if not isinstance(got, dict) else ""
            lines.append(f"{path}: {e['msg']}{got_text}")
    return lines


def build_config(raw: dict[str, Any]) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        lines = format_validation_error(err, ExperimentConfig)
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read YAML (or start from defaults), apply `key=value` overrides, validate the schema."""
    raw = read_yaml(path) if path is not None else {}
    raw = apply_overrides(raw, overrides or [])
    return build_config(raw)


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
