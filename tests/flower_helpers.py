"""Shared helpers of the Flower tests (imported, not collected): a small store per client."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from embedcache.store.importer import import_features

C, D = 4, 12
# why the Flower tests skip where the optional extra is absent (CI installs it through [dev])
FLOWER_MISSING = "flwr is not installed: the optional [flower] extra (pip install -e '.[flower]', part of '.[dev]')"
CLIENTS = ("c0", "c1", "c2")


def write_store(root: Path, clients: tuple[str, ...] = CLIENTS, seed: int = 0, name: str = "st.zarr",
                only: str | None = None) -> Path:
    """One store holding `clients` (or only `only` of them, with the same features: a node's own
    store). c1 lacks class 3 (padding, FedPCL's local sets pad it with the global prototype)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(C, D)) * 1.5
    store = Path(root) / name
    for ci, c in enumerate(clients):
        for split, n in (("train", 40), ("test", 30)):
            y = rng.integers(0, C - 1 if c == "c1" else C, n)
            x = (means[y] + rng.normal(size=(n, D)) + 0.4 * ci).astype(np.float32)
            if only is not None and c != only:
                continue
            f = Path(root) / f"{name}-{c}-{split}.npz"
            np.savez(f, features=x, labels=y)
            import_features(store, f, backbone="synth", client=c, split=split, domain=f"dom{ci}",
                            classes=[f"k{i}" for i in range(C)])
    return store
