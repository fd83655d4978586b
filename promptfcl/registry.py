"""The registries: datasets and methods by name (no if/elif factories); backbones use timm's own registry.

Each package registers into these instances (`data.register_dataset`, `methods.base.register_method`); every
other module looks names up here, or through the package that re-exports them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from promptfcl.data.base import DatasetSpec
    from promptfcl.federation.protocol import MethodSpec

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised when a registry is asked for a name it does not hold; the message lists the choices."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain sentence
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to registered objects; `register` is a decorator, `get` explains unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, self._items, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}.{hint} Use one of: {', '.join(sorted(self._items))}."

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())


DATASETS: Registry[DatasetSpec] = Registry("dataset")
METHODS: Registry[MethodSpec] = Registry("method")
