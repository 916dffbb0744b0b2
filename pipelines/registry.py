"""The experiment registry: every table and figure the pipelines reproduce, by name.

Nothing lists the experiments: every module `pipelines/exp_*.py` is imported (in file-name
order) and its experiments registered: its `EXPERIMENTS` tuple when it has one (that order),
else every `Experiment` it binds at module level (definition order). A module's `PAPERS`
{short name: citation} adds the papers its experiments cite. A new experiment is one such file
(or a call to `register` from a plugin); nothing else changes."""

from __future__ import annotations

import fnmatch
import importlib
from pathlib import Path

from embedcache.errors import UserError
from pipelines.spec import Experiment

PAPERS: dict[str, str] = {}  # short name -> citation, from the experiment modules' PAPERS

_REGISTRY: dict[str, Experiment] = {}
_LOADED = False


def register(exp: Experiment) -> Experiment:
    """Add (or replace) an experiment; it is checked for internal consistency first."""
    _REGISTRY[exp.name] = exp.check()
    return exp


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    plugins = dict(_REGISTRY)  # registered before the built-in ones were loaded: keep them, last
    for path in sorted(Path(__file__).parent.glob("exp_*.py")):
        mod = importlib.import_module(f"{__package__}.{path.stem}")
        PAPERS.update(getattr(mod, "PAPERS", {}))
        listed = getattr(mod, "EXPERIMENTS", None)
        for exp in listed if listed is not None else [v for v in vars(mod).values() if isinstance(v, Experiment)]:
            if exp.name not in _REGISTRY:  # an experiment another module imported is that module's
                register(exp)
    for exp in plugins.values():
        _REGISTRY.pop(exp.name)
        _REGISTRY[exp.name] = exp


def experiments() -> list[Experiment]:
    _load()
    return list(_REGISTRY.values())


def get(name: str) -> Experiment:
    _load()
    if name not in _REGISTRY:
        close = fnmatch.filter(_REGISTRY, f"*{name}*")
        hint = f" (did you mean {', '.join(close[:3])}?)" if close else " (see `python -m pipelines list`)"
        raise UserError(f"experiment {name!r}: unknown{hint}")
    return _REGISTRY[name]


def select(patterns: tuple[str, ...] | list[str]) -> list[Experiment]:
    """Experiments named by `patterns` (exact names, shell globs such as 'fedpcl-*', or 'all'), in
    registry order, each once."""
    _load()
    names: list[str] = []
    for pat in patterns:
        if pat == "all":
            hits = list(_REGISTRY)
        elif any(ch in pat for ch in "*?["):
            hits = [n for n in _REGISTRY if fnmatch.fnmatchcase(n, pat)]
            if not hits:
                raise UserError(f"experiment pattern {pat!r}: matches nothing (see `python -m pipelines list`)")
        else:
            hits = [get(pat).name]
        names += [n for n in hits if n not in names]
    order = list(_REGISTRY)
    return [_REGISTRY[n] for n in sorted(names, key=order.index)]
