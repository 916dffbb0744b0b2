"""The order the vectorised engine stacks clients in, applied and undone inside the engine.

Local steps compute only the clients still stepping (core/train.py): stacked largest first, those
are always a prefix of the stack, so no round has to reorder the clients' rows (and undo it) to
skip the ones already done. `run(..., reorder=True)` (core/engine.py) therefore trains a padded
federation largest first where that is safe, and hands back every per-client result (client
state, accuracies, the server-state rows the algorithm declares in `server_client_fields`) in the
caller's order. A client's own result does not depend on its place in the stack: its
initialisation, batches and noise are keyed by its global id (data.client_index); only the order
in which the server sums the clients' messages follows the stack.

Safe means: every client in every round (the seeded draw of participants is by position), the
vectorised engine (the loop computes one client at a time, nothing to skip), a padded federation
(buckets keep their own order) and an algorithm that declares which server-state fields hold a
row per client, so that all of its state can be put back."""

from __future__ import annotations

from typing import Any

import torch

from fedheads.core.tree import tree_index


def stacking_order(algorithm: Any, data: Any, fraction: float, engine: str) -> tuple[int, ...] | None:
    """The positions in `data` of the clients in the order the engine stacks them (largest
    training split first, stable: FedData.by_size), or None: `data`'s own order (module docstring
    for when; also when `data` is in that order already)."""
    if algorithm.server_client_fields is None:  # AlgorithmBase: positions it cannot put back
        return None
    if engine != "vectorized" or fraction < 1.0 or len(data.groups()) != 1:
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
