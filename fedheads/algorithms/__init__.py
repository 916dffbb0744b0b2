"""Algorithm registry: one file per paper; `create_algorithm(name, **config_fields)`.

A module registers its algorithms with `register_algorithm(name, factory, description=...,
config=ConfigClass)`, where `factory(**kwargs) -> Algorithm` builds the algorithm from the
fields of its config dataclass. The declared `config` is what `--set`, `--config`,
`--dump-config` and `fedheads algorithms NAME` read (fedheads.run.options): the keys an algorithm
takes are known without building it. Nothing lists the modules: every file of this package that
registers an algorithm at module level, and every module an installed package names in the entry
point group `fedheads.algorithms`, is found by fedheads.algorithm_names and imported here."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedheads.core.protocol import AlgorithmBase


@dataclass(frozen=True)
class AlgorithmInfo:
    name: str  # registry name
    description: str  # one line
    factory: Callable[..., AlgorithmBase]  # kwargs -> algorithm
    config: type | None = None  # the config dataclass whose fields the factory takes (None: undeclared)
    fixed: Mapping[str, str] = field(default_factory=dict)  # {field of `config` this registration sets itself: why}


_REGISTRY: dict[str, AlgorithmInfo] = {}


def register_algorithm(name: str, factory: Callable[..., AlgorithmBase], *, description: str,
                       config: type | None = None, fixed: Mapping[str, str] | None = None) -> None:
    """Add (or replace) an algorithm under `name`. `config`: the frozen config dataclass whose
    fields `factory` takes as keywords (the optimiser's parts flat: fedheads.core.optim.config_from_kwargs);
    without it the keys are read off one default build. `fixed`: fields of `config` that this
    registration sets itself (lp's `hidden`), refused as settings, with why."""
    _REGISTRY[name] = AlgorithmInfo(name, description, factory, config, dict(fixed or {}))


def algorithm_info(name: str) -> AlgorithmInfo:
    """The registration of `name` (UserError naming the known ones for an unknown name)."""
    _load()
    if name not in _REGISTRY:
        from embedcache.errors import unknown_name

        raise unknown_name(name, _REGISTRY, "algorithm")
    return _REGISTRY[name]


_LOADED: list[bool] = []


def _load() -> None:
    """Import every module of this package that registers an algorithm and load every entry point
    of the group `fedheads.algorithms` (fedheads.algorithm_names), once; an entry point that fails
    to load is one line naming it."""
    if _LOADED:
        return
    _LOADED.append(True)
    from importlib.metadata import entry_points

    from fedheads.algorithm_names import GROUP, builtin

    for mod in dict.fromkeys(d.module for d in builtin()):
        importlib.import_module(mod)
    for ep in entry_points(group=GROUP):
        try:
            ep.load()
        except Exception as exc:  # a third-party package's failure: one line, not our traceback
            from embedcache.errors import UserError

            msg = " ".join(str(exc).split()) or "(no message)"
            raise UserError(f"entry point {ep.name} ({ep.value}) of {GROUP}: cannot be loaded "
                            f"({type(exc).__name__}: {msg})") from None


def list_algorithms() -> list[AlgorithmInfo]:
    _load()
    return sorted(_REGISTRY.values(), key=lambda i: i.name)


def create_algorithm(name: str, **kwargs: Any) -> AlgorithmBase:
    """Build a registered algorithm from its config fields (UserError on unknown name, on a field
    the registration fixes, or on a factory whose result does not subclass the declared protocol)."""
    info = algorithm_info(name)
    fixed = next((k for k in kwargs if k in info.fixed), None)
    if fixed is not None:
        from embedcache.errors import UserError

        raise UserError(f"{fixed}: not a setting of {name}: {info.fixed[fixed]}")
    alg = info.factory(**kwargs)
    if not isinstance(alg, AlgorithmBase):
        from embedcache.errors import UserError

        raise UserError(f"algorithm {name!r}: its factory returned a {type(alg).__name__}, which does not subclass "
                        "fedheads.core.protocol.AlgorithmBase (the declared protocol: docs/custom_algorithm.md)")
    return alg
