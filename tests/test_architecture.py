"""The package's import graph keeps its layers: no cycle; a method's folder imports only the shared layers, the base
floor (`methods/base/`) and the folders of the methods its paper builds on (`register_method(builds_on=...)`);
shared layers import no method; a module only one method uses lives in that method's folder; the validity gate and
the Flower layer name no method.

Imports are read from the source (every `import` / `from … import`, function-level ones included; those under
`if TYPE_CHECKING:` excluded, as they never run).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

import promptfcl
from promptfcl.methods import METHODS

PACKAGE = Path(promptfcl.__file__).parent
METHODS_PKG = "promptfcl.methods"
BASE = "promptfcl.methods.base"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(name: str) -> set[str]:
    """The promptfcl modules `name` imports (`from pkg import mod` resolves to the module when it is one)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("promptfcl"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if not base.startswith("promptfcl"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def in_base(module: str) -> bool:
    return module == BASE or module.startswith(BASE + ".")


def unit_of(module: str) -> str | None:
    """The method folder a module belongs to (`promptfcl.methods.<unit>`), None for shared layers and the base."""
    if not module.startswith(METHODS_PKG + ".") or in_base(module):
        return None
    return module.split(".")[2]


def declared_bases() -> dict[str, set[str]]:
    """unit → the units of the methods its registered methods declare they build on."""
    out: dict[str, set[str]] = defaultdict(set)
    for _, spec in METHODS.items():
        for other in spec.builds_on:
            out[unit_of(spec.module)].add(unit_of(METHODS.get(other).module))
    return out


def test_the_import_graph_has_no_cycle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_a_method_folder_imports_only_shared_layers_the_base_and_its_declared_bases() -> None:
    allowed = declared_bases()
    bad = []
    for module, targets in GRAPH.items():
        unit = unit_of(module)
        if unit is None:
            continue
        for t in targets:
            other = unit_of(t)
            if t == METHODS_PKG or (other is not None and other != unit and other not in allowed[unit]):
                bad.append(f"{module} imports {t}")
    assert not bad, "a method imports another method's folder it does not declare in builds_on:\n" + "\n".join(bad)
    assert allowed["c2prompt"] == {"powder"} and allowed["capt"] == {"clip_baselines"}


def test_shared_layers_and_the_base_import_no_method() -> None:
    bad = [
        f"{module} imports {t}"
        for module, targets in GRAPH.items()
        if unit_of(module) is None and module != METHODS_PKG
        for t in targets
        if unit_of(t) is not None or (t == METHODS_PKG and in_base(module))
    ]
    assert not bad, "\n".join(bad)


def test_a_module_used_by_one_method_only_lives_in_that_methods_folder() -> None:
    importers: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        for t in targets:
            importers[t].add(module)
    bad = []
    for module in GRAPH:
        if unit_of(module) is not None or module == METHODS_PKG:
            continue
        users = importers[module]
        units = {unit_of(u) for u in users}
        if users and len(units) == 1 and None not in units:
            bad.append(f"{module} is used only by methods/{units.pop()}/")
    assert not bad, "move these into their method's folder:\n" + "\n".join(bad)


def test_every_registered_method_is_registered_from_a_method_folder() -> None:
    for name, spec in METHODS.items():
        assert unit_of(spec.module) is not None, (name, spec.module)
        for program in (spec.server, spec.client):
            assert unit_of(program.__module__) in (None, unit_of(spec.module), *declared_bases()[unit_of(spec.module)])


FLOWER = [str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "flower").glob("*.py"))]


@pytest.mark.parametrize("path", ["evaluation/validity.py", *FLOWER])
def test_the_validity_gate_and_the_flower_layer_name_no_method(path: str) -> None:
    text = (PACKAGE / path).read_text().lower()
    named = [m for m in METHODS if re.search(rf"(?<![\w/.-]){re.escape(m)}(?![\w-])", text)]
    assert not named, f"{path} names {named}: methods declare what they add instead"


def test_the_graph_reader_sees_imports(tmp_path: Path) -> None:
    """The checks above only mean something if imports are read: a known edge of each kind is present."""
    assert "promptfcl.methods.base.fedavg" in GRAPH["promptfcl.methods.hgp"] or any(
        t.startswith(BASE) for t in GRAPH["promptfcl.methods.hgp"]
    )
    assert "promptfcl.methods.powder" in GRAPH["promptfcl.methods.c2prompt"]  # a declared base
    assert "promptfcl.methods.hepco.latent_generator" in GRAPH["promptfcl.methods.hepco"]  # within a folder
    assert "promptfcl.federation.protocol" in GRAPH["promptfcl.methods.base.registration"]
