"""Helpers over "stacked trees": frozen dataclasses / dicts / tuples whose tensor leaves carry a
leading client axis [M, ...]. Client states and messages follow that convention, so the engines
can select, scatter and concatenate them without knowing the algorithm (fedjax-style backends).
Non-tensor leaves (ints, strings, None) are passed through unchanged.

A message whose clients send different numbers of items (FedCOF's means of the classes each
client holds) may instead lay them out as consecutive runs, one per client, in leaves [Q, ...]
beside its [M, ...] leaves: such a type is :class:`RaggedRows`. Concatenating two of them leaf by
leaf along dim 0 must give the message of their clients in order (so `tree_cat` needs nothing
more); the type says how to take client rows (`client_rows`, used by `tree_index` and
`tree_rows`) and how large one client's part is (`comm_size`, used by `payload_size`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")


@runtime_checkable
class RaggedRows(Protocol):
    """A tree whose leaves are not all [M, ...]: runs of items per client (module docstring)."""

    def client_rows(self, idx: torch.Tensor) -> Any:
        """The tree of clients `idx` (rows of its client axis, in that order). It only takes
        rows of its leaves of two or more dimensions, never computes on them (the vectorised
        engine finds where those rows go on their row numbers: core/order.py cat_put_back)."""
        ...

    def comm_size(self) -> tuple[int, int]:
        """(values, bytes) one client sends (payload_size with per_client)."""
        ...


def tree_map(fn: Callable[..., Any], tree: T, *rest: Any) -> T:
    """Apply `fn` to every tensor leaf (and the matching leaves of `rest`, same structure)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree, *rest)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {
            f.name: tree_map(fn, getattr(tree, f.name), *(getattr(r, f.name) for r in rest))
            for f in dataclasses.fields(tree)
        }
        return dataclasses.replace(tree, **changes)
    if isinstance(tree, dict):
        return type(tree)({k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()})  # type: ignore[return-value]
    if isinstance(tree, (tuple, list)):
        return type(tree)(tree_map(fn, v, *(r[i] for r in rest)) for i, v in enumerate(tree))  # type: ignore[return-value]
    return tree


def tree_leaves(tree: Any) -> list[torch.Tensor]:
    """All tensor leaves, in a deterministic order."""
    out: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        out.append(t)
        return t

    tree_map(collect, tree)
    return out


def tree_index(tree: T, idx: torch.Tensor) -> T:
    """Rows `idx` of the client axis of every leaf (a sub-federation); a RaggedRows tree's own
    `client_rows`."""
    if isinstance(tree, RaggedRows):
        return tree.client_rows(idx)
    return tree_map(lambda t: t.index_select(0, idx.to(t.device)), tree)


def tree_scatter(full: T, idx: torch.Tensor, part: T) -> T:
    """`full` with rows `idx` of the client axis replaced by `part` (out of place)."""

    def put(f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        out = f.clone()
        out[idx.to(f.device)] = p.to(f.dtype)
        return out

    return tree_map(put, full, part)


def tree_scatter_(full: T, idx: torch.Tensor, part: T) -> T:
    """In-place `tree_scatter` (the caller owns `full`, e.g. a per-round copy); returns `full`."""

    def put(f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        f[idx.to(f.device)] = p.to(f.dtype)
        return f

    return tree_map(put, full, part)


def row_range(ids: Sequence[int]) -> tuple[int, int] | None:
    """(a, b) when `ids` are the consecutive rows a, a+1, ..., b-1; else None."""
    ids = list(ids)
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(j == i + 1 for i, j in zip(ids, ids[1:])):
        return ids[0], ids[-1] + 1
    return None


def tree_rows(tree: T, ids: Sequence[int], device: torch.device | str = "cpu") -> T:
    """Rows `ids` of the client axis of every leaf: views when they are consecutive (a size bucket
    of clients stored largest first), else a copy (tree_index)."""
    span = row_range(ids)
    if span is None or isinstance(tree, RaggedRows):
        return tree_index(tree, torch.tensor(list(ids), dtype=torch.int64, device=device))
    a, b = span
    return tree_map(lambda t: t[a:b], tree)


def tree_put_rows_(full: T, ids: Sequence[int], part: T) -> T:
    """In place: rows `ids` of `full`'s client axis := `part` (`tree_scatter_`; a slice copy when the
    rows are consecutive, nothing where `part`'s leaf already is that slice). Returns `full`."""
    span = row_range(ids)
    if span is None:
        return tree_scatter_(full, torch.tensor(list(ids), dtype=torch.int64), part)
    a, b = span
    # a part leaf that views `full` elsewhere than its own destination (a pure client_update may
    # return an input field under another name) is copied first: the writes below would change it
    part = tree_map(lambda f, p: p if _is_slice(p, f, a, b) or not shares_memory(p, full) else p.clone(), full, part)

    def put(f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if not _is_slice(p, f, a, b):
            f[a:b].copy_(p)
        return f

    return tree_map(put, full, part)


def _is_slice(p: torch.Tensor, f: torch.Tensor, a: int, b: int) -> bool:
    dst = f[a:b]
    return p.data_ptr() == dst.data_ptr() and p.shape == dst.shape and p.stride() == dst.stride()


def shares_memory(t: torch.Tensor, tree: Any) -> bool:
    """Whether tensor `t` lies in the storage of one of `tree`'s leaves."""
    ptr = t.untyped_storage().data_ptr()
    return any(leaf.untyped_storage().data_ptr() == ptr for leaf in tree_leaves(tree))


def unshared(tree: T, other: Any) -> T:
    """`tree` with every leaf that lies in the storage of one of `other`'s leaves copied."""
    return tree_map(lambda t: t.clone() if shares_memory(t, other) else t, tree)


def tree_cat_chunks(chunks: Iterable[tuple[int, T]], total: int) -> T:
    """`tree_cat` of parts made one after another: (first row, part) pairs written into leaves of
    `total` rows allocated from the first part, each part dropped before the next is made. The
    peak holds the result and one part, where tree_cat holds every part and their concatenation."""
    out: Any = None
    for a, part in chunks:
        if out is None:
            out = tree_map(lambda t: t.new_empty((total, *t.shape[1:])), part)
        tree_map(lambda o, t: o[a:a + t.shape[0]].copy_(t), out, part)  # noqa: B023 (used at once)
        del part
    if out is None:
        raise ValueError("tree_cat_chunks: no parts")
    return out


def tree_cat(parts: Sequence[T]) -> T:
    """Concatenate trees along the client axis (loop engine: M=1 messages -> one stacked message;
    RaggedRows trees concatenate their runs the same way, module docstring)."""
    if len(parts) == 1:
        return parts[0]
    return tree_map(lambda *ts: torch.cat(ts, 0), parts[0], *parts[1:])


def tree_where(cond: torch.Tensor, new: T, old: T) -> T:
    """Per client: `new` where cond[m] else `old` (cond is [M] bool)."""

    def pick(n: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        c = cond.view(-1, *([1] * (n.dim() - 1)))
        return torch.where(c, n, o)

    return tree_map(pick, new, old)


def payload_size(tree: Any, per_client: bool = True) -> tuple[int, int]:
    """(values, bytes) of every tensor field sent: numel and numel*itemsize.

    With `per_client`, leaves have a leading client axis and the size of ONE client's part is
    returned (numel / M). A type may define `comm_size(self) -> (values, bytes)` to report a
    sparser encoding that it actually sends (e.g. only valid rows)."""
    if hasattr(tree, "comm_size"):
        return tree.comm_size()
    n = b = 0
    for t in tree_leaves(tree):
        numel = t.numel() // (t.shape[0] if per_client and t.dim() > 0 and t.shape[0] > 0 else 1)
        n += numel
        b += numel * t.element_size()
    return n, b
