"""The feature store is read chunk by chunk straight into the padded tensors, and the vectorised
engine evaluates large federations in groups of clients: both give exactly what the simple
paths (whole arrays through FedData.from_arrays; one predict call for everyone) give."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embedcache.errors import UserError
from embedcache.store.importer import import_features
from embedcache.store.reader import load_split
from fedheads.algorithms.fedncm import FedNCM
from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig
from fedheads.core import engine
from fedheads.run.load import from_arrays, load_fed_data


def _store(root: Path, sizes: dict[str, tuple[int, int]], dims=(("a", 5), ("b", 3))) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    store = root / "s.zarr"
    for c, (ntr, nte) in sizes.items():
        for split, n in (("train", ntr), ("test", nte)):
            y = rng.integers(0, 3, n)
            for bb, d in dims:
                f = root / f"{bb}-{c}-{split}.npz"
                np.savez(f, features=rng.normal(size=(n, d)).astype("f4"), labels=y)
                import_features(store, f, backbone=bb, client=c, split=split, domain=f"d{c}",
                                classes=["k0", "k1", "k2"])
    return store


def test_chunked_load_equals_whole_arrays(tmp_path: Path) -> None:
    store = _store(tmp_path, {"c0": (11, 4), "c1": (3, 0), "c2": (7, 5)})
    got = load_fed_data(str(store), ["a", "b"], device="cpu", chunk_rows=2)  # several chunks per client
    tr, te = load_split(store, ["a", "b"], "train"), load_split(store, ["a", "b"], "test")
    want = from_arrays([(tr[c].features, tr[c].labels, te[c].features, te[c].labels) for c in tr], 3,
                               list(tr), [tr[c].domain for c in tr])
    for f in ("x_train", "y_train", "m_train", "x_test", "y_test", "m_test", "client_index"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    for f in ("n_train", "n_test", "num_classes", "client_names", "domains"):
        assert getattr(got, f) == getattr(want, f), f
    assert got.x_train.shape == (3, 11, 8) and got.n_test == (4, 0, 5)
    one = load_fed_data(str(store), ["b"], device="cpu", clients=["c2"], binarize=True)
    assert one.client_names == ("c2",) and one.dim == 3
    assert torch.equal(one.x_train, torch.sign(want.x_train[2:3, :7, 5:]))


def test_chunked_load_refuses_bad_stores(tmp_path: Path) -> None:
    store = _store(tmp_path / "a", {"c0": (4, 2), "c1": (0, 2)})
    with pytest.raises(UserError, match="c1: no training samples"):
        load_fed_data(str(store), ["a"], device="cpu")
    with pytest.raises(UserError, match="nosuch"):
        load_fed_data(str(store), ["nosuch"], device="cpu")


@pytest.mark.parametrize("make", [FedNCM, lambda: FedPCL(FedPCLConfig(hidden=4, batch_size=4))])
def test_grouped_evaluation_equals_one_call(monkeypatch, make) -> None:
    rng = np.random.default_rng(1)
    clients = []
    for n_te in (5, 2, 7, 1, 4):
        y = rng.integers(0, 3, 12)
        yt = rng.integers(0, 3, n_te)
        clients.append(((np.eye(3, 6)[y] * 2 + rng.normal(size=(12, 6))).astype("f4"), y,
                        (np.eye(3, 6)[yt] * 2 + rng.normal(size=(n_te, 6))).astype("f4"), yt))
    data = from_arrays(clients, 3)
    alg = make()
    res = engine.run(alg, data, rounds=2, progress=False)  # final states, evaluated both ways below
    whole = engine.evaluate(alg, res.client_state, res.server_state, data)
    monkeypatch.setattr(engine, "EVAL_GROUP_BYTES", 2 * 7 * 6 * 4)  # two clients per predict call
    grouped = engine.evaluate(alg, res.client_state, res.server_state, data)
    for k in whole:
        torch.testing.assert_close(grouped[k], whole[k], equal_nan=True)
    torch.testing.assert_close(whole["main"], res.final_accuracy())
