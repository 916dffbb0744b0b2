"""Full-participation runs on the vectorised engine train the clients largest first
(fedheads.data.largest_first: local steps then compute only the clients still stepping, without
re-ordering them every round) and report everything in the store's order: `fedheads train` /
`compare` and the API load the store in that order (no second copy), in-memory federations are
sorted once, and a client's result does not depend on its place in the stack (its
initialisation, batches and noise are keyed by its global id). The loop engine, sampled runs and
plugin algorithms that do not declare `server_client_fields` keep the store's order."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fed_tiny import tiny_fed

from embedcache.store.importer import import_features
from fedheads.core import engine
from fedheads.core.tree import tree_leaves
from fedheads.data import FedData, in_store_order, largest_first, load_fed_data
from fedheads.layout import to_layout
from fedheads.runner import TrainOptions, build_algorithm, compare_runs, load_state, train_run, trains_largest_first


class _Plain:
    """A plugin algorithm that does not say which server-state fields hold a row per client."""

    def __init__(self) -> None:
        from fedheads.algorithms.fedavg import FedAvg

        self._inner = FedAvg()

    def __getattr__(self, name):
        if name == "server_client_fields":
            raise AttributeError(name)
        return getattr(self._inner, name)


SIZES = {"c0": (5, 6), "c1": (23, 5), "c2": (9, 0), "c3": (23, 4), "c4": (14, 6)}  # c2: no test rows


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lf")
    rng = np.random.default_rng(3)
    centers = rng.normal(size=(3, 8)) * 2
    store = root / "s.zarr"
    for c, (ntr, nte) in SIZES.items():
        for split, n in (("train", ntr), ("test", nte)):
            y = rng.integers(0, 3, n)
            f = root / f"{c}-{split}.npz"
            np.savez(f, features=(centers[y] + rng.normal(size=(n, 8))).astype("f4"), labels=y)
            import_features(store, f, backbone="b", client=c, split=split, domain=f"d{c}", classes=["k0", "k1", "k2"])
    return store


def test_loading_largest_first_equals_sorting_after_loading(store) -> None:
    got = load_fed_data(str(store), ["b"], device="cpu", largest_first=True, chunk_rows=4)
    want, order = load_fed_data(str(store), ["b"], device="cpu").by_size()
    assert order == (1, 3, 4, 2, 0) and tuple(got.client_index.tolist()) == order
    for f in ("x_train", "y_train", "m_train", "x_test", "y_test", "m_test", "client_index"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    for f in ("n_train", "n_test", "client_names", "domains"):
        assert getattr(got, f) == getattr(want, f), f
    # the bucketed layout keeps its buckets and the store's order
    b = load_fed_data(str(store), ["b"], device="cpu", largest_first=True, layout="bucketed")
    assert b.client_names == tuple(SIZES)


def test_in_store_order_and_run_result_round_trip() -> None:
    data = tiny_fed(M=5, seed=2)
    fast, order = largest_first(data)
    assert list(fast.n_train) == sorted(data.n_train, reverse=True) and order != tuple(range(5))
    assert in_store_order(fast.client_names, order) == list(data.client_names)
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", eval_every=1, progress=False)
    assert trains_largest_first(["fedavg", "fedpcl"], opts)
    assert not trains_largest_first(["fedavg"], dataclasses.replace(opts, fraction=0.6))  # the draw is by position
    assert not trains_largest_first(["fedavg"], dataclasses.replace(opts, engine="loop"))  # nothing to skip
    from fedheads.algorithms import _REGISTRY, register_algorithm

    register_algorithm("plain-fedavg", lambda **cfg: _Plain(), description="test double")
    try:  # a plugin that does not declare its server rows
        assert not trains_largest_first(["fedavg", "plain-fedavg"], opts)
    finally:
        _REGISTRY.pop("plain-fedavg", None)
    res = engine.run(build_algorithm("fedpcl", opts)[0], fast, 2, seed=0, eval_every=1, progress=False)
    back = res.in_client_order(order)
    for k in res.client_state.params:
        assert torch.equal(back.client_state.params[k][list(order)], res.client_state.params[k])
    assert torch.equal(back.final_accuracy()[list(order)], res.final_accuracy())
    half = engine.run(build_algorithm("fedavg", opts)[0], data, 2, seed=0, fraction=0.6, progress=False)
    with pytest.raises(ValueError, match="every client"):
        half.in_client_order(order)


@pytest.mark.parametrize("algorithm", ["fedpcl", "solo", "fedavg"])
def test_a_clients_result_does_not_depend_on_its_place(algorithm) -> None:
    """FedPCL and Solo initialise each client's own head: seeded by its global id, the sorted run
    ends where the store-order run ends, client by client (up to the server's sum order)."""
    data = tiny_fed(M=5, seed=2)
    fast, order = largest_first(data)
    opts = TrainOptions(rounds=3, seeds=(1,), device="cpu", eval_every=1, progress=False)
    a = engine.run(build_algorithm(algorithm, opts)[0], data, 3, seed=1, eval_every=1, progress=False)
    alg = build_algorithm(algorithm, opts)[0]
    b = engine.run(alg, fast, 3, seed=1, eval_every=1, progress=False)
    b = b.in_client_order(order, getattr(alg, "server_client_fields", ()))  # FedPCL: its prototype bank too
    torch.testing.assert_close(b.final_accuracy(), a.final_accuracy(), rtol=0, atol=1e-6, equal_nan=True)
    for x, y in zip(tree_leaves((b.client_state, b.server_state)), tree_leaves((a.client_state, a.server_state))):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    # the bucketed layout of the sorted stack seeds each client by its global id as well
    buck = to_layout(fast, "bucketed")
    assert buck.spec().ids() == tuple(fast.client_index.tolist()) == fast.spec().ids()


@pytest.mark.parametrize("algorithm", ["fedpcl", "fedrep"])
def test_train_trains_largest_first_and_writes_the_store_order(store, tmp_path, monkeypatch, algorithm) -> None:
    import fedheads.runner as runner

    seen: list[tuple[int, ...]] = []
    real = runner.run
    monkeypatch.setattr(runner, "run", lambda alg, d, *a, **k: seen.append(d.n_train) or real(alg, d, *a, **k))
    opts = TrainOptions(rounds=3, seeds=(0,), device="cpu", eval_every=1, progress=False, layout="padded")
    res = train_run(str(store), ["b"], algorithm, opts, tmp_path / "run")
    assert seen == [(23, 23, 14, 9, 5)]
    names = list(SIZES)
    assert res["clients"] == names and res["domains"] == [f"d{c}" for c in names]
    # the engine on the store's order: the same per-client accuracies and final states
    data = load_fed_data(str(store), ["b"], device="cpu")
    alg = build_algorithm(algorithm, opts)[0]
    ref = real(alg, data, 3, seed=0, eval_every=1, progress=False)
    want = {n: 100.0 * a for n, a in zip(names, ref.final_accuracy().tolist()) if a == a}
    assert json.loads((tmp_path / "run" / "results.json").read_text())["clients"] == names
    per_client = {c: v["mean"] for c, v in res["per_client"].items() if v["mean"] is not None}
    assert list(per_client) == list(want) and res["per_client"]["c2"]["n_test"] == 0
    torch.testing.assert_close(torch.tensor(list(per_client.values())), torch.tensor(list(want.values())),
                               rtol=0, atol=1e-4)
    cs, ss = load_state(tmp_path / "run" / "state" / "seed0.pt", alg, data.spec(), 0)
    for x, y in zip(tree_leaves((cs, ss)), tree_leaves((ref.client_state, ref.server_state))):
        # stacked GEMMs round differently for 5 rows in another order; Adam amplifies that to ~1e-5
        # (the tolerance of tests/test_engine_equivalence.py)
        torch.testing.assert_close(x, y, rtol=1e-3, atol=5e-5)
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    assert [r.split(",")[2] for r in rows[:len(names)]] == names


def test_compare_and_sampled_runs(store, tmp_path, monkeypatch) -> None:
    import fedheads.runner as runner

    seen: list[tuple[int, ...]] = []
    real = runner.run
    monkeypatch.setattr(runner, "run", lambda alg, d, *a, **k: seen.append(d.n_train) or real(alg, d, *a, **k))
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False, layout="padded")
    combined = compare_runs(str(store), ["b"], ["fedavg", "fedncm"], opts, tmp_path / "cmp")
    assert seen == [(23, 23, 14, 9, 5)] * 2
    assert all(r["clients"] == list(SIZES) for r in combined["algorithms"].values())
    seen.clear()
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False, layout="padded", fraction=0.6)
    train_run(str(store), ["b"], "fedavg", opts, tmp_path / "half")
    assert seen == [tuple(n for n, _ in SIZES.values())]
    # features given in memory are sorted once for the run, the caller's federation untouched
    seen.clear()
    data = load_fed_data(str(store), ["b"], device="cpu")
    x = data.x_train.clone()
    res = train_run(None, ["b"], "fedavg", TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False),
                    tmp_path / "mem", data=data)
    assert seen == [(23, 23, 14, 9, 5)] and res["clients"] == list(SIZES) and torch.equal(data.x_train, x)
    assert isinstance(data, FedData)


def _spy_runs(monkeypatch) -> list[tuple[int, ...]]:
    import fedheads.runner as runner

    seen: list[tuple[int, ...]] = []
    real = runner.run
    monkeypatch.setattr(runner, "run", lambda alg, d, *a, **k: seen.append(d.n_train) or real(alg, d, *a, **k))
    return seen


def test_loop_engine_keeps_the_store_order_bit_for_bit(store, tmp_path, monkeypatch) -> None:
    """The loop runs one client at a time: nothing to skip, so no sort, and its server sums stay in
    the store's order (the Flower simulation equals `fedheads train --engine loop` bit for bit)."""
    seen = _spy_runs(monkeypatch)
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False, layout="padded", engine="loop")
    train_run(str(store), ["b"], "fedproto", opts, tmp_path / "loop")
    assert seen == [tuple(n for n, _ in SIZES.values())]
    data = load_fed_data(str(store), ["b"], device="cpu")
    alg = build_algorithm("fedproto", opts)[0]
    ref = engine.run(alg, data, 2, seed=0, engine="loop", progress=False)
    cs, ss = load_state(tmp_path / "loop" / "state" / "seed0.pt", alg, data.spec(), 0)
    for x, y in zip(tree_leaves((cs, ss)), tree_leaves((ref.client_state, ref.server_state))):
        assert torch.equal(x, y)


def test_a_plugin_without_server_client_fields_keeps_the_store_order(store, tmp_path, monkeypatch) -> None:
    from fedheads.algorithms import _REGISTRY, register_algorithm

    seen = _spy_runs(monkeypatch)
    register_algorithm("plain-fedavg", lambda **cfg: _Plain(), description="test double")
    try:
        opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False, layout="padded")
        res = train_run(str(store), ["b"], "plain-fedavg", opts, tmp_path / "plain")
    finally:
        _REGISTRY.pop("plain-fedavg", None)
    assert seen == [tuple(n for n, _ in SIZES.values())] and res["clients"] == list(SIZES)


def test_the_api_loads_the_store_largest_first_without_a_copy(store, tmp_path, monkeypatch) -> None:
    import fedheads

    seen = _spy_runs(monkeypatch)
    copies: list[int] = []
    select = FedData.select
    monkeypatch.setattr(FedData, "select", lambda self, ids: copies.append(len(ids)) or select(self, ids))
    res = fedheads.train(str(store), "fedavg", backbones="b", rounds=2, seeds=0, device="cpu", layout="padded")
    assert seen == [(23, 23, 14, 9, 5)] and copies == [] and res.clients == list(SIZES)
    # arrays are stacked, then sorted once for the run
    seen.clear()
    arrays = {c: (np.ones((n, 3), "f4") * i, np.arange(n) % 2, np.ones((2, 3), "f4"), np.array([0, 1]))
              for i, (c, (n, _)) in enumerate(SIZES.items())}
    res = fedheads.train(arrays, "fedavg", rounds=1, seeds=0, device="cpu")
    assert seen == [(23, 23, 14, 9, 5)] and res.clients == list(SIZES)


def test_the_checkpoint_says_its_order(store, tmp_path) -> None:
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False, layout="padded")
    train_run(str(store), ["b"], "fedavg", opts, tmp_path / "run")
    blob = torch.load(tmp_path / "run" / "state" / "seed0.ckpt.pt", map_location="cpu", weights_only=True)
    data = json.loads(blob["config"])["data"]
    assert data["train_order"] == "largest first" and data["clients"] == list(SIZES)
