"""The experiment registry: every table and figure the pipelines reproduce, by name.

Adding an experiment is one `Experiment` entry in one of the `exp_*` modules (or a call to
`register` from a plugin); nothing else changes."""

from __future__ import annotations

import fnmatch

from embedcache.errors import UserError
from pipelines.spec import Experiment

PAPERS = {
    "FedPCL": "Tan et al., \"Federated Learning from Pre-Trained Models: A Contrastive Learning Approach\", "
              "NeurIPS 2022",
    "FedNCM": "Legate et al., \"Guiding The Last Layer in Federated Learning with Pre-Trained Models\", "
              "NeurIPS 2023",
    "FedCOF": "Goswami et al., \"Covariances for Free: Exploiting Mean Distributions for Training-free Federated "
              "Learning\", NeurIPS 2025",
    "FedDRA": "FedDRA: federated distributionally robust vision-language alignment (under review at TMLR)",
}

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
    from pipelines import exp_feddra, exp_fedncm, exp_fedpcl, exp_fedpcl_more, exp_training_free

    for exp in (exp_fedpcl.TABLE2, exp_fedpcl.TABLE3, exp_fedpcl.TABLE11, exp_fedpcl.TABLE4,
                *exp_fedpcl_more.EXPERIMENTS, *exp_fedncm.EXPERIMENTS, *exp_feddra.EXPERIMENTS,
                *exp_training_free.EXPERIMENTS):
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
