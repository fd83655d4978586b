"""Scenario families: the cells of a comparison that ran the same scenario, each given its own table and figures.

Two cells belong together when their runs' `data` and `scenario` config sections are equal apart from the seed
(`scenario_identity`): compared with every scenario default filled in (a config written before a field existed
reads as its default), without the machine's paths and reading options (`data.root`, `cache` …), without the
sub-sections and partition parameters the scenario's kind does not use (an asynchronous run's Dirichlet β, a
class-incremental run's `personalized` section), and without two keys that do not change which data a run sees:
`rounds_per_task` (a training budget: a zero-shot or probe reference row runs one round on the same tasks) and
`upper_bound` (an upper-bound row is the reference of its federated family). A personalized run therefore never
shares a table or a figure with a class-incremental one, nor a HePCo-partitioned run with a Dirichlet one.
Each family is named from its config (`family_label`): "class-incremental, Dirichlet β = 0.05, 5 tasks × 10
classes, 5 clients; cifar100, 100/20 train/test per class".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from promptfcl.config import dotted_keys
from promptfcl.report.collect import Group

DATA_KEYS = ("name", "train_per_class", "test_per_class", "options")  # which images; the rest is where / how read
NOT_SCENARIO = ("rounds_per_task", "upper_bound")
KIND_SECTIONS = {"asynchronous": "asynchronous", "personalized": "personalized", "long_tail": "long_tailed"}
PARTITION_PARAMS = {
    "dirichlet": ("beta", "min_samples", "max_retries"),
    "iid": ("min_samples",),
    "hepco": ("category_ratio", "split_ratio", "imbalance"),
}
KIND_NAMES = {"class_incremental": "class-incremental", "asynchronous": "asynchronous task switching"}


@dataclass
class Family:
    """Cells (groups of seeds) that ran one scenario: one table, one validity table and one set of figures."""

    label: str
    identity: dict[str, Any]
    groups: list[Group] = field(default_factory=list)


def _prune(value: Any) -> Any:
    """Drop None / empty entries, so an absent key and one written out as null or {} compare equal."""
    if isinstance(value, dict):
        out = {k: _prune(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}
    return value


def _with_defaults(scenario: dict[str, Any]) -> dict[str, Any]:
    """The scenario section with every default filled in (as the run read it); as written when it no longer
    validates (a config from an older version)."""
    from promptfcl.config import ScenarioConfig

    try:
        return ScenarioConfig.model_validate(scenario).model_dump(mode="json")
    except Exception:  # noqa: BLE001 - any validation failure: compare the section as written
        return dict(scenario)


def _relevant(s: dict[str, Any]) -> dict[str, Any]:
    """The scenario keys its kind uses: no other kind's section, only its partition kind's parameters."""
    s = {k: v for k, v in s.items() if k not in NOT_SCENARIO}
    kind = s.get("kind", "class_incremental")
    for section, user in KIND_SECTIONS.items():
        if kind != user:
            s.pop(section, None)
    p = dict(s.get("partition") or {})
    if kind == "asynchronous":  # own task sequences: the partition is not used
        s.pop("partition", None)
    elif kind == "personalized":  # its own Dirichlet β; the partition's redraw limits only
        s["partition"] = {k: p[k] for k in ("min_samples", "max_retries") if k in p}
    elif p:
        pk = p.get("kind", "dirichlet")
        params = PARTITION_PARAMS.get(pk, tuple(k for k in p if k != "kind"))
        s["partition"] = {"kind": pk, **{k: p[k] for k in params if k in p}}
    return s


def scenario_identity(cfg: dict[str, Any]) -> dict[str, Any]:
    """What makes two runs' scenarios the same (module docstring): the relevant `data` and `scenario` keys, the
    scenario's defaults filled in."""
    scenario = _relevant(_with_defaults(_relevant(cfg.get("scenario") or {})))
    data = {k: v for k, v in (cfg.get("data") or {}).items() if k in DATA_KEYS}
    return _prune({"data": data, "scenario": scenario})


def _num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _partition_text(p: dict[str, Any]) -> str:
    kind = p.get("kind", "dirichlet")
    if kind == "dirichlet":
        return f"Dirichlet β = {_num(p.get('beta', 0.5))}"
    if kind == "hepco":
        return (
            f"HePCo partition (κ = {_num(p.get('category_ratio'))}, γ = {_num(p.get('split_ratio'))}, "
            f"β = {_num(p.get('imbalance'))})"
        )
    return "IID partition" if kind == "iid" else f"{kind} partition"


def _task_sizes(run_dir: Path | None) -> list[int]:
    """Classes per task from a run's scenario.json (when the config leaves them to the default split)."""
    path = run_dir / "scenario.json" if run_dir is not None else None
    if path is None or not path.is_file():
        return []
    try:
        tasks = json.loads(path.read_text()).get("task_classes") or []
        return [len(t) for t in tasks if isinstance(t, list)]
    except (ValueError, AttributeError):
        return []


def _tasks_text(s: dict[str, Any], run_dir: Path | None) -> str:
    kind, n, per = s.get("kind", "class_incremental"), s.get("num_tasks"), s.get("classes_per_task")
    tasks = f"{n} task{'s' if n != 1 else ''}"
    if kind in ("asynchronous", "personalized"):  # every client its own sequence
        return f"{tasks} × {per} classes per client" if isinstance(per, int) else f"{tasks} per client"
    if isinstance(per, list):
        sizes = per
    elif isinstance(per, int):
        sizes = [per] * (n or 0)
    else:  # the default even split: read it from the scenario
        sizes = _task_sizes(run_dir)
    if sizes and len(set(sizes)) == 1:
        return f"{tasks} × {sizes[0]} classes"
    return f"{tasks} ({' / '.join(map(str, sizes))} classes)" if sizes else tasks


def family_label(cfg: dict[str, Any], run_dir: Path | None = None) -> str:
    """A family's readable name from its config, e.g. `class-incremental, Dirichlet β = 0.05, 5 tasks × 10 classes,
    5 clients; cifar100, 100/20 train/test per class`."""
    if not cfg:
        return "scenario not recorded (no config.yaml)"
    s, d = cfg.get("scenario") or {}, cfg.get("data") or {}
    kind = s.get("kind", "class_incremental")
    parts: list[str] = []
    if kind == "personalized":
        q = s.get("personalized") or {}
        mode = q.get("mode", "asynchronous")
        parts.append(f"personalized {mode}")
        if mode == "asynchronous":
            parts.append(f"{q.get('private_classes')} private + {q.get('public_classes')} public classes")
        parts.append(f"Dirichlet β = {_num(q.get('beta'))}")
    elif kind == "asynchronous":
        parts.append(KIND_NAMES[kind])
    else:
        if kind == "long_tailed":
            lt = s.get("long_tail") or {}
            factor = lt.get("imbalance_factor")
            profile = "the dataset's own class counts" if lt.get("profile") == "dataset" else f"IF = {_num(factor)}"
            parts.append(f"long-tailed ({profile})")
        else:
            parts.append(KIND_NAMES.get(kind, kind.replace("_", " ")))
        parts.append(_partition_text(s.get("partition") or {}))
    parts += [_tasks_text(s, run_dir), f"{s.get('num_clients')} clients"]
    share = (s.get("participation") or {}).get("fraction", 1.0)
    if share and share < 1:
        parts.append(f"{share:.0%} of clients per {(s.get('participation') or {}).get('mode', 'per_task')[4:]}")
    if s.get("domains"):
        parts.append("per-client image domains")
    data = d.get("name", "?")
    if d.get("train_per_class") or d.get("test_per_class"):
        data += f", {d.get('train_per_class')}/{d.get('test_per_class')} train/test per class"
    return ", ".join(parts) + f"; {data}"


def group_families(groups: list[Group]) -> list[Family]:
    """The finished groups by scenario family, families in the order of their first cell; labels made unique by
    naming the keys in which a family differs from an earlier one of the same name."""
    families: dict[str, Family] = {}
    for g in groups:
        if not g.runs:
            continue
        run = g.runs[0]
        identity = scenario_identity(run.config) if run.config else {}
        key = json.dumps(identity, sort_keys=True)
        if key not in families:
            families[key] = Family(family_label(run.config, run.run_dir), identity)
        families[key].groups.append(g)
    out = list(families.values())
    for j, fam in enumerate(out):
        same = [f for f in out[:j] if f.label == fam.label]
        if same:
            a, b = dotted_keys(same[0].identity), dotted_keys(fam.identity)
            diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            fam.label += " [" + ", ".join(f"{k} = {b.get(k, '–')}" for k in diff[:3]) + "]"
        taken = {f.label for f in out[:j]}
        base, n = fam.label, 2
        while fam.label in taken:
            fam.label, n = f"{base} ({n})", n + 1
    return out
