"""Checks of names and plain values that need neither torch nor the registries: the `fedheads`
command line runs them before it imports torch (a typo is refused in well under a second, not
after the 9-28 s torch takes to load on a busy machine), and the options dataclasses run them
again, so the Python API refuses the same values with the same line.

The algorithm names come from fedheads.algorithm_names (read off the sources and installed
packages' metadata, no import); the other built-in lists are static, and tests/test_checks.py checks
each equals its registry. Names registered by a plugin (`--plugin`) are only known once it is
imported: the registry itself is then asked (it is loaded by then anyway)."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from embedcache.errors import UserError, unknown_name

# fedheads finetune --head (fedheads.finetuning.heads.HEADS): the registered algorithms whose state defines a
# linear head (AlgorithmBase.linear_head), then K rounds of LP and the random head
FINETUNE_HEADS = ("fedncm", "fed3r", "fedcof", "lp", "random")
FEDDRA_BASELINES = ("feddra", "fedavg", "fedavg-two-stage", "fedprox", "no-two-stage", "no-constraint",
                    "no-dro")  # fedheads feddra --baseline (fedheads.alignment.runner.BASELINES)


def known_algorithms() -> list[str]:
    """The algorithm names: the declared ones (fedheads.algorithm_names), or the registry's once
    something imported it (a plugin that registers its own algorithm does)."""
    if "fedheads.algorithms" in sys.modules:
        from fedheads.algorithms import list_algorithms

        return [i.name for i in list_algorithms()]
    from fedheads.algorithm_names import declared

    return [d.name for d in declared()]


def check_algorithms(names: Sequence[str]) -> None:
    known = known_algorithms()
    for n in names:
        if n not in known:
            raise unknown_name(n, known, "algorithm")


def finetune_heads(names: Sequence[str] = ()) -> list[str]:
    """The --head choices of `fedheads finetune`: the table above, plus (only when one of `names`
    is not in it) every registered algorithm whose state defines a linear head
    (AlgorithmBase.linear_head), so a new algorithm file needs no entry."""
    known = list(FINETUNE_HEADS)
    if any(n not in known and n in known_algorithms() for n in names):
        from fedheads.algorithms import create_algorithm, list_algorithms
        from fedheads.core.protocol import AlgorithmBase

        for info in list_algorithms():
            if info.name not in known and type(create_algorithm(info.name)).linear_head is not AlgorithmBase.linear_head:
                known.insert(-2, info.name)  # before "lp" and "random"
    return known


def check_finetune_heads(names: Sequence[str], flag: str = "--head") -> None:
    check_choices(names, finetune_heads(names), "head", flag)


def check_choices(names: Sequence[str], known: Sequence[str], what: str, flag: str) -> None:
    """Each of `names` is one of `known`, each once."""
    for n in names:
        if n not in known:
            raise UserError(f"{flag}: {unknown_name(n, known, what)}")
    if len(set(names)) != len(names):
        raise UserError(f"{flag} {','.join(names)}: name each method once")


def check_seeds(seeds: Sequence[int], flag: str = "--seeds") -> None:
    """At least one seed, each once: a spread over a repeated seed is no spread."""
    if not seeds:
        raise UserError(f"{flag}: at least one seed is needed")
    twice = sorted({s for s in seeds if list(seeds).count(s) > 1})
    if twice:
        raise UserError(f"{flag} {','.join(map(str, seeds))}: seed {', '.join(map(str, twice))} given more than "
                        "once; give each seed once")


def _pairs(obj: Any) -> bool:
    """(key, value) pairs, the form --set settings take in the options dataclasses."""
    return isinstance(obj, (list, tuple)) and bool(obj) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) for p in obj)


def first_leaf(obj: Any, test: Callable[[Any], Any], path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], Any] | None:
    """(path, test(leaf)) of the first leaf of `obj` (dataclasses, mappings, (key, value) pairs and
    sequences, walked in order) for which `test` is not None; None when there is none."""
    found = test(obj)
    if found is not None:
        return path, found
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items: Iterable[tuple[str, Any]] = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    elif isinstance(obj, Mapping):
        items = ((str(k), v) for k, v in obj.items())
    elif _pairs(obj):
        items = ((k, v) for k, v in obj)
    elif isinstance(obj, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        return None
    for k, v in items:
        hit = first_leaf(v, test, (*path, k))
        if hit is not None:
            return hit
    return None


def first_non_finite(obj: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], float] | None:
    """(path, value) of the first float in `obj` that is NaN or infinite; None when all are finite."""
    return first_leaf(obj, lambda v: v if isinstance(v, float) and not math.isfinite(v) else None, path)


FINITE_CHUNK = 1 << 20  # elements non_finite_count checks at a time


def non_finite_count(t: Any) -> int:
    """How many values of tensor `t` are NaN or infinite, counted FINITE_CHUNK elements at a time:
    over a whole tensor, torch.isfinite makes an absolute-value copy and a bool mask of it, and
    summing the mask an int64 copy, together more than twice a float32 tensor's bytes at once,
    which for a large federation's per-client weights (FedPCL's projections) rose above the
    run's peak memory at its end."""
    import torch

    n = torch.zeros((), dtype=torch.int64, device=t.device)
    # a contiguous tensor (the states' leaves) in views of its flat storage; another in blocks of
    # its first axis of about FINITE_CHUNK values (each block's copy, not the whole tensor's)
    if t.is_contiguous() or t.dim() < 2:
        parts = t.reshape(-1).split(FINITE_CHUNK)
    else:
        parts = t.split(max(1, FINITE_CHUNK // max(1, t[0].numel())), dim=0)
    for c in parts:
        n += c.numel() - torch.isfinite(c.reshape(-1)).sum()
    return int(n)  # one device sync, not one per chunk


def check_trained_state(states: dict[str, Any], algorithm: str, seed: int) -> None:
    """A run whose final state ({name: tree}) holds NaN or infinite values failed (it diverged:
    too large a learning rate, say); it is refused in one line naming the seed and the first such
    field, before anything marks the run directory complete."""
    import torch  # only here: the rest of this module runs before torch is imported

    def bad(t: Any) -> tuple[int, int] | None:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            return None
        n = non_finite_count(t)
        return (n, t.numel()) if n else None

    found = first_leaf(states, bad)
    if found is not None:
        path, (n, total) = found
        raise UserError(f"{algorithm}, seed {seed}: training diverged, the trained state is not finite "
                        f"({'.'.join(path)}: {n} of {total} values NaN or infinite); no results written "
                        "(a smaller --lr?)")


def check_finite(obj: Any, set_fields: Sequence[str] = ("settings", "lp_settings")) -> None:
    """UserError naming the first setting of `obj` (an options dataclass) that is NaN or infinite,
    as the command line spells it: `--lr nan`, `--set lr=inf`. A non-finite learning rate or
    weight trains to a NaN model that would otherwise look like a normal run."""
    found = first_non_finite(obj)
    if found is None:
        return
    path, value = found
    if path and path[0] in set_fields and len(path) > 1:
        raise UserError(f"--set {'.'.join(path[1:])}={value}: must be a finite number")
    leaf = next((p for p in reversed(path) if not p.isdigit()), "value")
    raise UserError(f"--{leaf.replace('_', '-')} {value}: must be a finite number")


def store_with(store: str | None, backbones: Sequence[str], required: bool = True) -> Any:
    """The store opened to check that it has `backbones` (a run reads it, not opened again; zarr
    and numpy, no torch); a store that does not exist is refused here, before torch loads, unless
    not `required` (--dump-config needs none: None)."""
    from pathlib import Path

    if store is not None and not Path(store).exists() and required:
        raise UserError(f"{store}: no feature store here (the directory does not exist; make one with "
                        "`embedcache extract` or `embedcache import`)")
    if store is None or not Path(store).exists():
        return None
    from embedcache.errors import did_you_mean
    from embedcache.store.reader import open_store

    info = open_store(store)
    for b in backbones:
        if b not in info.backbones:
            raise UserError(f"backbone {b!r}: not in store {info.path}{did_you_mean(b, info.backbones)} "
                            f"(has: {', '.join(info.backbones)})")
    return info
