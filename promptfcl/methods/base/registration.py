"""The method registry: `register_method(...)` in each method file, `METHODS.get(name)` everywhere else."""

from __future__ import annotations

from pydantic import BaseModel

from promptfcl.federation.protocol import ClientProgram, MethodSpec, ModelFactory, ServerProgram
from promptfcl.registry import Registry

METHODS: Registry[MethodSpec] = Registry("method")


def register_method(
    name: str,
    params: type[BaseModel],
    server: type[ServerProgram],
    client: type[ClientProgram],
    build_model: ModelFactory | None,
    summary: str,
    paper: str = "",
    scenario_kinds: tuple[str, ...] | None = None,
) -> MethodSpec:
    """Register a method under `name`; its `params` model holds the paper's defaults.

    `scenario_kinds` lists the `scenario.kind`s the method is defined on (None: every kind); configs pairing it
    with another kind are refused up front.
    """
    spec = MethodSpec(name, params, server, client, build_model, summary, paper, scenario_kinds)
    METHODS.register(name)(spec)
    return spec
