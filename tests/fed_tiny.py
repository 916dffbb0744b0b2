"""A tiny synthetic federation for core/engine/algorithm tests (imported, not collected)."""

from __future__ import annotations

import numpy as np

from fedheads.core.federation import FedData
from fedheads.run.load import from_arrays


def tiny_fed(M: int = 4, D: int = 6, C: int = 3, seed: int = 0) -> FedData:
    rs = np.random.default_rng(seed)
    centers = rs.normal(size=(C, D)) * 2
    clients = []
    for i in range(M):
        n = int(rs.integers(3, 30))
        classes = rs.choice(C, size=2, replace=False) if i % 2 else np.arange(C)  # some lack a class
        y = rs.choice(classes, size=n)
        x = (centers[y] + rs.normal(size=(n, D))).astype("f4")
        yt = rs.choice(classes, size=8)
        xt = (centers[yt] + rs.normal(size=(8, D))).astype("f4")
        clients.append((x, y, xt, yt))
    return from_arrays(clients, C)


def pooled(clients: list) -> tuple[np.ndarray, np.ndarray]:
    """Every client's training rows together: (x float64, y)."""
    return np.concatenate([c[0] for c in clients]).astype(np.float64), np.concatenate([c[1] for c in clients])


def few_rows(D: int, C: int, rows: int, seed: int = 4, M: int = 3, test_rows: int = 30) -> list:
    """M clients of `rows` training rows of D-d Gaussian classes (fewer rows in all than
    dimensions: the singular systems of the closed-form heads), as from_arrays takes them."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(C, D)) * 3
    clients = []
    for _ in range(M):
        y = rng.integers(0, C, rows)
        yt = rng.integers(0, C, test_rows)
        clients.append(((centres[y] + rng.normal(size=(rows, D))).astype(np.float32), y,
                        (centres[yt] + rng.normal(size=(test_rows, D))).astype(np.float32), yt))
    return clients


def check_secure_form(alg, data: FedData):
    """The secure form's server step on the summed per-client rows equals the plain server step on
    the stacked message (every leaf of the state), and its sums are what DP covers. Returns the
    plain server state."""
    import torch

    from fedheads.core.protocol import RoundCtx
    from fedheads.core.tree import tree_leaves

    M = data.num_clients
    init = alg.init(data.spec(), seed=0)
    ctx = RoundCtx(0, 0, torch.arange(M), M)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx)
    plain, _ = alg.server_aggregate(init.server_state, msg, ctx)
    form = alg.secure_form(msg)
    rows = [form.sums(msg.client_rows(torch.tensor([i]))) for i in range(M)]
    assert set(rows[0]) == set(alg.dp_sensitivity(1.0))
    secure, _ = form.aggregate(init.server_state, None, {k: sum(r[k] for r in rows) for k in rows[0]}, ctx)
    for ta, tb in zip(tree_leaves(secure), tree_leaves(plain)):
        torch.testing.assert_close(ta, tb, rtol=1e-9, atol=1e-10)
    return plain
