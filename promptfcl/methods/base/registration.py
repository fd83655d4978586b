"""`register_method`: what a method's folder calls once to join the registry (`promptfcl.registry.METHODS`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from promptfcl.federation.protocol import ClientProgram, MethodSpec, ModelFactory, ServerProgram, ValiditySignal
from promptfcl.registry import METHODS


def register_method(
    name: str,
    params: type[BaseModel],
    server: type[ServerProgram],
    client: type[ClientProgram],
    build_model: ModelFactory | None,
    summary: str,
    paper: str = "",
    scenario_kinds: tuple[str, ...] | None = None,
    signals: tuple[ValiditySignal, ...] = (),
    builds_on: tuple[str, ...] = (),
    variant: Callable[[Any], tuple[type[ServerProgram], type[ClientProgram]] | None] | None = None,
) -> MethodSpec:
    """Register a method under `name`; its `params` model holds the paper's defaults.

    `scenario_kinds` lists the `scenario.kind`s the method is defined on (None: every kind); configs pairing it
    with another kind are refused up front. `signals` are the method's own validity checks (each reads a
    finished run's evidence and returns a `Check`, or None when the run carries no such evidence; the validity
    gate applies them beside the generic checks). `builds_on` names the methods whose folders this one may import
    because its paper builds on them (e.g. C2Prompt on Powder); any other method-to-method import is refused by
    the architecture test. `variant(params)` may select other (server, client) classes for a structural switch
    (None: the registered ones).
    """
    module = sys._getframe(1).f_globals.get("__name__", "")  # the registering method's module (its folder)
    spec = MethodSpec(
        name, params, server, client, build_model, summary, paper, scenario_kinds, signals, builds_on, variant, module
    )
    METHODS.register(name)(spec)
    return spec
