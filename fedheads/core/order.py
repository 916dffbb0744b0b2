"""The order the vectorised engine stacks clients in, applied and undone inside the engine.

Local steps compute only the clients still stepping (core/train.py): stacked largest first, those
are always a prefix of the stack, so no round has to reorder the clients' rows (and undo it) to
skip the ones already done. `run(..., reorder=True)` (core/engine.py) therefore trains a padded
federation largest first where that is safe, and hands back every per-client result (client
state, accuracies, the server-state rows the algorithm declares in `server_client_fields`) in the
caller's order. A client's own result does not depend on its place in the stack: its
initialisation, batches and noise are keyed by its global id (data.client_index); only the order
of sums over clients follows the stack: the server's over their messages, and any a client takes
over per-client rows of the broadcast (FedPCL's Eq. 9 over every client's local set). So the
states differ from a run in the data's order in the last bits, and a long run's accuracy with them.

Safe means: every client in every round (the seeded draw of participants is by position), the
vectorised engine (the loop computes one client at a time, nothing to skip), a padded federation
(buckets keep their own order) and an algorithm that declares which server-state fields hold a
row per client, so that all of its state can be put back."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from fedheads.core.tree import tree_cat, tree_index, tree_leaves, tree_map


def stacking_order(algorithm: Any, data: Any, fraction: float, engine: str) -> tuple[int, ...] | None:
    """The positions in `data` of the clients in the order the engine stacks them (largest
    training split first, stable: FedData.by_size), or None: `data`'s own order (module docstring
    for when; also when `data` is in that order already)."""
    if algorithm.server_client_fields is None:  # AlgorithmBase: positions it cannot put back
        return None
    if engine != "vectorized" or fraction < 1.0 or len(data.members) != 1:  # one group: padded, or a streamed
        # plan of one bucket, which data.select reads whole into a padded FedData (as bucketed gives it)
        return None
    order = tuple(sorted(range(data.num_clients), key=lambda i: -data.n_train[i]))
    return None if order == tuple(range(data.num_clients)) else order


def put_back(tree: Any, order: list[int] | tuple[int, ...], device: torch.device) -> Any:
    """Rows of a tree stacked in `order` (positions in another order) put into that order, i.e.
    ascending positions (index on `device`; leaves keep their own)."""
    perm = sorted(range(len(order)), key=order.__getitem__)
    if perm == list(range(len(order))):
        return tree
    return tree_index(tree, torch.tensor(perm, dtype=torch.int64, device=device))


RELEASE_BYTES = 64 << 20  # cat_put_back calls `release` once this many bytes of parts are dropped


def cat_put_back(parts: list[Any], order: list[int] | tuple[int, ...], device: torch.device,
                 release: Callable[[], None] | None = None) -> Any:
    """put_back(tree_cat(parts), order, device) without holding the concatenation beside its
    reordered copy: the rows of every leaf of two or more dimensions (the bulk: a RaggedRows
    message's items, e.g. FedCOF's class means) are copied from each part straight to their
    place in the result, and the part is dropped from `parts` (emptied on return; `release`
    called once RELEASE_BYTES of them are dropped and after the last, e.g. to hand their memory
    back), so the round holds the parts and the result's rows written so far, not two whole
    copies. Where each row goes is found on a skeleton of the parts in which those leaves are
    their row numbers; the other leaves (run lengths, labels) are concatenated and reordered as
    put_back does. A RaggedRows type's `client_rows` must only take rows of its leaves of two or
    more dimensions, never compute on them (core/tree.py). Pure copies: equal to
    put_back(tree_cat(parts)) bit for bit."""
    first = tree_leaves(parts[0])
    bulk = [j for j, t in enumerate(first) if t.dim() >= 2]
    span: list[dict[int, tuple[int, int]]] = []  # per part: bulk leaf -> (its first row in the concatenation, rows)
    total = dict.fromkeys(bulk, 0)
    skeletons = []
    for part in parts:
        leaves = tree_leaves(part)
        span.append({j: (total[j], leaves[j].shape[0]) for j in bulk})
        for j in bulk:
            total[j] += leaves[j].shape[0]
        rows = {j: torch.arange(a, a + n, device=leaves[j].device).unsqueeze(1) for j, (a, n) in span[-1].items()}
        skeletons.append(_with_leaves(part, rows))
    skeleton = put_back(tree_cat(skeletons), order, device)
    del skeletons
    src = {j: t.squeeze(1) for j, t in enumerate(tree_leaves(skeleton)) if j in total}
    out, dest = {}, {}
    for j in bulk:  # allocated, not written: pages are taken as rows arrive
        if src[j].numel() != total[j]:
            raise ValueError(f"cat_put_back: leaf {j}'s reordered rows are not a permutation of its {total[j]} rows")
        out[j] = first[j].new_empty((total[j], *first[j].shape[1:]))
        dest[j] = torch.empty_like(src[j]).index_copy_(0, src[j], torch.arange(total[j], device=src[j].device))
    del first, src
    dropped = 0  # bytes of the parts dropped since `release` was last called
    for p in range(len(parts)):
        leaves = tree_leaves(parts[p])
        for j in bulk:
            a, n = span[p][j]
            out[j].index_copy_(0, dest[j][a:a + n].to(out[j].device), leaves[j])
            dropped += leaves[j].numel() * leaves[j].element_size()
        del leaves
        parts[p] = None
        if release is not None and (dropped >= RELEASE_BYTES or p == len(parts) - 1):
            release()
            dropped = 0
    parts.clear()
    return _with_leaves(skeleton, out)


def _with_leaves(tree: Any, new: dict[int, torch.Tensor]) -> Any:
    """`tree` with its tensor leaves numbered j (tree_leaves order) in `new` replaced by new[j]."""
    count = itertools.count()

    def swap(t: torch.Tensor) -> torch.Tensor:
        return new.get(next(count), t)

    return tree_map(swap, tree)
