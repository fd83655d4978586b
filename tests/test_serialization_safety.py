"""Serialization safety: nothing in the package can unpickle untrusted bytes, and every message any registered
method sends or receives carries only plain tensors and JSON scalars (and survives a safetensors round trip)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import promptfcl
from promptfcl.config import ConfigError, build_config
from promptfcl.experiment import Experiment
from promptfcl.federation.inprocess import InProcessGrid
from promptfcl.federation.message import Message
from promptfcl.methods import METHODS

from .conftest import tiny_raw

PACKAGE = Path(promptfcl.__file__).parent
FORBIDDEN = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "cPickle.load",
    "cPickle.loads", "dill.load", "dill.loads", "joblib.load", "marshal.load", "marshal.loads", "shelve.open",
    "yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "jsonpickle.decode", "numpy.lib.format.read_array",
    "eval", "exec",
}  # fmt: skip
# the project's own loaders count as safe only while they subclass PyYAML's SafeLoader (checked below)
PROJECT_YAML_LOADERS = {"ConfigLoader": "promptfcl.config"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", *PROJECT_YAML_LOADERS}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name → dotted origin, from the module's imports (`import numpy as np`, `from pickle import loads`)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def unsafe_loads(source: str, filename: str = "<src>") -> list[str]:
    """Every call in `source` that could unpickle or execute untrusted data, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):  # an Unpickler subclass must restrict globals via find_class
            unpickler = {_dotted(b, aliases) for b in node.bases} & {"pickle.Unpickler", "_pickle.Unpickler"}
            if unpickler and not any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body):
                found.append(f"{filename}:{node.lineno}: Unpickler subclass without find_class")
            continue
        if not isinstance(node, ast.Call):
            continue
        name = (_dotted(node.func, aliases) or "").replace("np.", "numpy.", 1)
        where = f"{filename}:{node.lineno}"
        if name in FORBIDDEN:
            found.append(f"{where}: {name}")
        elif name == "torch.load":
            wo = _kw(node, "weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                found.append(f"{where}: torch.load without weights_only=True")
        elif name == "numpy.load":
            ap = _kw(node, "allow_pickle")
            if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                found.append(f"{where}: numpy.load with allow_pickle")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if (_dotted(loader, aliases) or "").split(".")[-1] not in SAFE_YAML_LOADERS:
                found.append(f"{where}: {name} without a safe Loader")
    return found


def test_the_scanner_finds_every_unsafe_pattern() -> None:
    bad = """
import pickle, yaml, marshal
import numpy as np
import torch as T
from pickle import loads as L
pickle.load(f); L(b); marshal.loads(b); yaml.load(s); yaml.unsafe_load(s); eval("1")
T.load("x"); T.load("x", weights_only=False); np.load("a.npy", allow_pickle=True)
class U(pickle.Unpickler):
    pass
"""
    found = unsafe_loads(bad)
    assert len(found) == 10, found
    ok = """
import yaml, torch, numpy as np, pickle
yaml.safe_load(s); yaml.load(s, Loader=yaml.SafeLoader); torch.load("x", weights_only=True); np.load("a.npy")
class R(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(name)
R(f).load()
"""
    assert unsafe_loads(ok) == []


def test_package_has_no_unsafe_loads() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    found = [x for f in files for x in unsafe_loads(f.read_text(), str(f.relative_to(PACKAGE)))]
    assert found == [], "unsafe deserialization:\n" + "\n".join(found)
    # the scanner does see the package's guarded loaders (so an empty result is not vacuous)
    text = {f.name: f.read_text() for f in files}
    assert "weights_only=True" in text["vit.py"] and "def find_class" in text["cifar.py"]


def _audit(msg: Any, where: str) -> None:
    assert type(msg) is Message, where
    for name, t in msg.tensors.items():
        assert type(t) is torch.Tensor, f"{where}: {name} is a {type(t).__name__}"
    assert json.loads(json.dumps(msg.scalars, allow_nan=False)) == msg.scalars, f"{where}: non-JSON scalars"
    back = Message.from_bytes(msg.to_bytes())
    assert back.kind == msg.kind and back.scalars == msg.scalars and back.tensors.keys() == msg.tensors.keys()
    assert all(torch.equal(back.tensors[k], v.cpu()) for k, v in msg.tensors.items()), where


SMALL = {"hepco": {"generator_iterations": 2, "kd_iterations": 2}, "capt": {"depth": 2}, "maple_fedavg": {"depth": 2}}
CLIP_METHODS = {"capt", "promptfl", "maple_fedavg", "cocoop_fedavg", "fedclip", "clip_zeroshot"}
SMALL["fedmgp"] = {"pool_size": 4, "length": 2, "top_k": 2, "local_layers": [1], "local_length": 2, "head_hidden": 16,
                   "proxy_per_class": 2, "fusion_epochs": 1}  # fmt: skip
# FedMGP needs a personalized scenario (its server distills on proxy data no client holds); its run also sends the
# client_local regime's `evaluate` messages, which the audit then covers too
PERSONALIZED = {
    "kind": "personalized", "num_tasks": 1, "num_clients": 2, "rounds_per_task": 1, "partition": {"min_samples": 0},
    "personalized": {"mode": "asynchronous", "private_classes": 1, "public_classes": 2},
}  # fmt: skip


# Powder needs per-(client, task) slots: the asynchronous scenario (two stages, so the signatures and the generated
# prompts of a second stage travel too)
SMALL["powder"] = {"components_per_task": 2, "length": 2, "layers": [3, 4]}
ASYNCHRONOUS = {
    "kind": "asynchronous", "num_tasks": 2, "num_clients": 2, "classes_per_task": 2, "rounds_per_task": 1,
    "asynchronous": {"data_slices": 2},
}  # fmt: skip


@pytest.mark.parametrize("method", sorted(name for name, _ in METHODS.items()))
def test_every_method_exchanges_only_tensors_and_json_scalars(method: str, tmp_path: Path, monkeypatch) -> None:
    raw = tiny_raw(
        data={"options": {"num_classes": 4, "train_per_class": 8, "test_per_class": 2}},
        scenario={"num_tasks": 1, "num_clients": 2, "rounds_per_task": 1, "partition": {"min_samples": 1}},
        backbone={"kwargs": {"patch_size": 8, "depth": 5, "embed_dim": 24, "num_heads": 2}},
    )
    raw["method"] = {"name": method, "local_epochs": 1, "batch_size": 8, **SMALL.get(method, {})}
    if method == "fedmgp":
        raw["scenario"] = dict(PERSONALIZED)
    if method == "powder":
        raw["scenario"] = dict(ASYNCHRONOUS)
    if method in CLIP_METHODS or METHODS.get(method).params.model_fields.get("n_ctx") is not None:
        pytest.importorskip("open_clip")
        from .clip_fixtures import tiny_lt_raw

        method_section = raw["method"]
        raw = tiny_lt_raw()
        raw["method"] = method_section
    seen: list[tuple[int, int]] = []
    original = InProcessGrid._deliver

    def audited(self: InProcessGrid, messages: dict[int, Message]) -> dict[int, Message]:
        for cid, m in messages.items():
            _audit(m, f"{method} → client {cid} ({m.kind})")
        replies = original(self, messages)
        for cid, r in replies.items():
            _audit(r, f"{method} ← client {cid} ({r.kind})")
        seen.append((len(messages), len(replies)))
        return replies

    monkeypatch.setattr(InProcessGrid, "_deliver", audited)
    try:
        exp = Experiment(build_config(raw), tmp_path, show_progress=False)
        exp.run()
    except ConfigError as e:  # every method must build on its backbone: a config error here is a failure
        pytest.fail(f"{method} did not build for the audit: {e}")
    assert seen or method == "clip_zeroshot"  # zero-shot CLIP is the one method that exchanges nothing
    assert all(sent == answered for sent, answered in seen)  # every client answered every message
    rounds = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert all(r["failures"] == [] for r in rounds), rounds  # every real reply passes the server's validation


def test_project_yaml_loaders_subclass_the_safe_loader() -> None:
    import importlib

    import yaml

    for name, module in PROJECT_YAML_LOADERS.items():
        loader = getattr(importlib.import_module(module), name)
        assert issubclass(loader, yaml.SafeLoader), f"{module}.{name} must subclass yaml.SafeLoader"
        with pytest.raises(yaml.constructor.ConstructorError):
            yaml.load("!!python/object/apply:os.system ['true']", Loader=loader)  # noqa: S506 - checking it refuses
