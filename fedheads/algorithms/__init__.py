"""Algorithm registry: one file per paper; `create_algorithm(name, **config_fields)`.

Other modules register themselves with `register_algorithm(name, factory, description=...)`,
where `factory(**kwargs) -> Algorithm` builds the algorithm from its config fields."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedheads.core.protocol import AlgorithmBase


@dataclass(frozen=True)
class AlgorithmInfo:
    name: str  # registry name
    description: str  # one line
    factory: Callable[..., AlgorithmBase]  # kwargs -> algorithm


_REGISTRY: dict[str, AlgorithmInfo] = {}
# modules imported lazily so that one broken/absent algorithm file does not break the others
_MODULES = tuple(f"fedheads.algorithms.{m}" for m in (
    "fedavg", "fedpcl", "fedproto", "fedncm", "fedrep", "pfedme", "perfedavg", "solo", "lp", "mlp", "fed3r", "fedcof",
    "ccvr", "fedpft"))


def register_algorithm(name: str, factory: Callable[..., AlgorithmBase], *, description: str) -> None:
    """Add (or replace) an algorithm under `name`."""
    _REGISTRY[name] = AlgorithmInfo(name, description, factory)


def _load() -> None:
    for mod in _MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def list_algorithms() -> list[AlgorithmInfo]:
    _load()
    return sorted(_REGISTRY.values(), key=lambda i: i.name)


def create_algorithm(name: str, **kwargs: Any) -> AlgorithmBase:
    """Build a registered algorithm from its config fields (UserError on unknown name, or on a
    factory whose result does not subclass the declared protocol)."""
    _load()
    if name not in _REGISTRY:
        from embedcache.errors import unknown_name

        raise unknown_name(name, _REGISTRY, "algorithm")
    alg = _REGISTRY[name].factory(**kwargs)
    if not isinstance(alg, AlgorithmBase):
        from embedcache.errors import UserError

        raise UserError(f"algorithm {name!r}: its factory returned a {type(alg).__name__}, which does not subclass "
                        "fedheads.core.protocol.AlgorithmBase (the declared protocol: docs/custom_algorithm.md)")
    return alg
