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
