"""The engine owns the order it stacks clients in: `run(..., reorder=True)` trains a padded
federation largest first where that is safe (core/order.py: every client in every round, the
vectorised engine, an algorithm that declares its per-client server rows) and hands back every
per-client result in the data's order. `fedheads train` / `compare`, the API and the pipelines
give it the store's order and see only that order; a client's result does not depend on its
place in the stack (its initialisation, batches and noise are keyed by its global id). The loop
engine, sampled runs and plugin algorithms that do not declare `server_client_fields` keep the
data's order."""

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
from fedheads.core.federation import FedData, to_layout
from fedheads.core.order import put_back, stacking_order
from fedheads.core.tree import tree_leaves
from fedheads.run.load import load_fed_data
from fedheads.run.saved import load_state
from fedheads.run.train import TrainOptions, build_algorithm, compare_runs, train_run

SIZES = {"c0": (5, 6), "c1": (23, 5), "c2": (9, 0), "c3": (23, 4), "c4": (14, 6)}  # c2: no test rows
LARGEST_FIRST = (23, 23, 14, 9, 5)
STORE_ORDER = tuple(n for n, _ in SIZES.values())


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


@pytest.fixture
def stacked(monkeypatch) -> list[tuple[int, ...]]:
    """The training sizes of the federation each engine run stacks (inside core/engine.py)."""
    seen: list[tuple[int, ...]] = []
    real = engine._run
    monkeypatch.setattr(engine, "_run", lambda alg, d, *a, **k: seen.append(d.n_train) or real(alg, d, *a, **k))
    return seen


def test_the_engine_chooses_largest_first_only_where_it_is_safe() -> None:
    data = tiny_fed(M=5, seed=2)
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False)
    fedavg = build_algorithm("fedavg", opts)[0]
    order = stacking_order(fedavg, data, 1.0, "vectorized")
    assert order == data.by_size()[1] and [data.n_train[i] for i in order] == sorted(data.n_train, reverse=True)
    assert stacking_order(fedavg, data, 0.6, "vectorized") is None  # the seeded draw is by position
    assert stacking_order(fedavg, data, 1.0, "loop") is None  # one client at a time: nothing to skip
    assert stacking_order(fedavg, data.by_size()[0], 1.0, "vectorized") is None  # in that order already
    from fedheads.core.federation import LayoutConfig

    assert stacking_order(fedavg, to_layout(data, LayoutConfig("bucketed", waste=1.0, bucket_clients=2)),
                          1.0, "vectorized") is None  # buckets keep their own order


@pytest.mark.parametrize("algorithm", ["fedpcl", "fedavg", "perfedavg"])
def test_reorder_is_the_largest_first_run_put_back_bit_for_bit(algorithm) -> None:
    """run(reorder=True) on the data's order IS the run of the largest-first stack, every
    per-client result put back: client state, accuracies and the declared server rows."""
    data = tiny_fed(M=5, seed=2)
    fast, order = data.by_size()
    opts = TrainOptions(rounds=3, seeds=(1,), device="cpu", progress=False)
    alg = build_algorithm(algorithm, opts)[0]
    got = engine.run(alg, data, 3, seed=1, progress=False, reorder=True)
    ref = engine.run(build_algorithm(algorithm, opts)[0], fast, 3, seed=1, progress=False)
    back = lambda t: put_back(t, order, torch.device("cpu"))  # noqa: E731
    for x, y in zip(tree_leaves(got.client_state), tree_leaves(back(ref.client_state))):
        assert torch.equal(x, y)
    for rg, rr in zip(got.history, ref.history):
        for k in rr.accuracy:
            torch.testing.assert_close(rg.accuracy[k], back(rr.accuracy[k]), rtol=0, atol=0, equal_nan=True)
    fields = alg.server_client_fields
    for f in dataclasses.fields(got.server_state):
        want = getattr(ref.server_state, f.name)
        want = back(want) if f.name in fields else want
        for x, y in zip(tree_leaves(getattr(got.server_state, f.name)), tree_leaves(want)):
            assert torch.equal(x, y), f.name
    assert (algorithm == "fedpcl") == bool(fields)


@pytest.mark.parametrize("algorithm", ["fedpcl", "solo", "fedavg"])
def test_a_clients_result_does_not_depend_on_its_place(algorithm) -> None:
    """FedPCL and Solo initialise each client's own head: seeded by its global id, the reordered
    run ends where the data-order run ends, client by client (up to the server's sum order)."""
    data = tiny_fed(M=5, seed=2)
    opts = TrainOptions(rounds=3, seeds=(1,), device="cpu", eval_every=1, progress=False)
    a = engine.run(build_algorithm(algorithm, opts)[0], data, 3, seed=1, eval_every=1, progress=False)
    b = engine.run(build_algorithm(algorithm, opts)[0], data, 3, seed=1, eval_every=1, progress=False, reorder=True)
    torch.testing.assert_close(b.final_accuracy(), a.final_accuracy(), rtol=0, atol=1e-6, equal_nan=True)
    for x, y in zip(tree_leaves((b.client_state, b.server_state)), tree_leaves((a.client_state, a.server_state))):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    # the bucketed layout of a sorted stack seeds each client by its global id as well
    fast = data.by_size()[0]
    buck = to_layout(fast, "bucketed")
    assert buck.spec().ids() == tuple(fast.client_index.tolist()) == fast.spec().ids()


@pytest.mark.parametrize("algorithm", ["fedpcl", "fedrep"])
def test_train_trains_largest_first_and_writes_the_store_order(store, tmp_path, stacked, algorithm) -> None:
    opts = TrainOptions(rounds=3, seeds=(0,), device="cpu", eval_every=1, progress=False, layout="padded")
    res = train_run(str(store), ["b"], algorithm, opts, tmp_path / "run")
    assert stacked == [LARGEST_FIRST]
    names = list(SIZES)
    assert res["clients"] == names and res["domains"] == [f"d{c}" for c in names]
    # the engine on the store's order: the same per-client accuracies and final states
    data = load_fed_data(str(store), ["b"], device="cpu")
    assert data.client_names == tuple(names)  # the loader keeps the store's order
    alg = build_algorithm(algorithm, opts)[0]
    ref = engine.run(alg, data, 3, seed=0, eval_every=1, progress=False)
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


def test_compare_and_sampled_runs(store, tmp_path, stacked) -> None:
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False, layout="padded")
    combined = compare_runs(str(store), ["b"], ["fedavg", "fedncm"], opts, tmp_path / "cmp")
    assert stacked == [LARGEST_FIRST] * 2
    assert all(r["clients"] == list(SIZES) for r in combined["algorithms"].values())
    stacked.clear()
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False, layout="padded", fraction=0.6)
    train_run(str(store), ["b"], "fedavg", opts, tmp_path / "half")
    assert stacked == [STORE_ORDER]
    # features given in memory: stacked largest first for the run, the caller's federation untouched
    stacked.clear()
    data = load_fed_data(str(store), ["b"], device="cpu")
    x = data.x_train.clone()
    res = train_run(None, ["b"], "fedavg", TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False),
                    tmp_path / "mem", data=data)
    assert stacked == [LARGEST_FIRST] and res["clients"] == list(SIZES) and torch.equal(data.x_train, x)
    assert isinstance(data, FedData) and data.n_train == STORE_ORDER


def test_loop_engine_keeps_the_store_order_bit_for_bit(store, tmp_path, stacked) -> None:
    """The loop runs one client at a time: nothing to skip, so no sort, and its server sums stay in
    the store's order (the Flower simulation equals `fedheads train --engine loop` bit for bit)."""
    opts = TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False, layout="padded", engine="loop")
    train_run(str(store), ["b"], "fedproto", opts, tmp_path / "loop")
    assert stacked == [STORE_ORDER]
    data = load_fed_data(str(store), ["b"], device="cpu")
    alg = build_algorithm("fedproto", opts)[0]
    ref = engine.run(alg, data, 2, seed=0, engine="loop", progress=False)
    cs, ss = load_state(tmp_path / "loop" / "state" / "seed0.pt", alg, data.spec(), 0)
    for x, y in zip(tree_leaves((cs, ss)), tree_leaves((ref.client_state, ref.server_state))):
        assert torch.equal(x, y)


def test_a_plugin_outside_the_declared_protocol_is_refused_by_name() -> None:
    """Every algorithm subclasses AlgorithmBase, so its server rows are always declared (the
    default is none): a factory returning anything else is refused in one line."""
    from embedcache.errors import UserError
    from fedheads.algorithms import _REGISTRY, create_algorithm, register_algorithm

    register_algorithm("plain-fedavg", lambda **cfg: object(), description="test double")
    try:
        with pytest.raises(UserError, match="plain-fedavg.*does not subclass.*AlgorithmBase"):
            create_algorithm("plain-fedavg")
    finally:
        _REGISTRY.pop("plain-fedavg", None)


def test_the_api_trains_largest_first_and_reports_the_store_order(store, stacked) -> None:
    import fedheads

    res = fedheads.train(str(store), "fedavg", backbones="b", rounds=2, seeds=0, device="cpu", layout="padded")
    assert stacked == [LARGEST_FIRST] and res.clients == list(SIZES)
    stacked.clear()
    arrays = {c: (np.ones((n, 3), "f4") * i, np.arange(n) % 2, np.ones((2, 3), "f4"), np.array([0, 1]))
              for i, (c, (n, _)) in enumerate(SIZES.items())}
    res = fedheads.train(arrays, "fedavg", rounds=1, seeds=0, device="cpu")
    assert stacked == [LARGEST_FIRST] and res.clients == list(SIZES)
