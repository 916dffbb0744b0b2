"""Feature layouts (fedheads/core/federation.py): the bucket plan's guarantees, bucketed data holding the
same rows as the padded layout (from arrays and from a store), the engine pieces the buckets
rely on, and the layout a `fedheads train` run records. Engine equality over every algorithm is
in tests/test_engine_equivalence.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from store_doubles import SKEWED, skewed_store

from embedcache.errors import UserError
from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig
from fedheads.algorithms.lp import HeadTuning, LPConfig
from fedheads.core import ops
from fedheads.core.engine import count_parameters, owned, run
from fedheads.core.federation import BucketedFedData, FedData, LayoutConfig, bucketing_pays, layout_info, plan_buckets, to_layout
from fedheads.core.tree import row_range, tree_cat, tree_cat_chunks, tree_put_rows_, tree_rows, tree_scatter_
from fedheads.run.load import from_arrays, load_fed_data


def _clients(ntr, nte=None, d=4, seed=0, views=False):
    rs = np.random.default_rng(seed)
    nte = nte or [max(1, n // 4) for n in ntr]
    out = [(rs.normal(size=(a, d)).astype("f4"), rs.integers(0, 3, a), rs.normal(size=(b, d)).astype("f4"),
            rs.integers(0, 3, b)) for a, b in zip(ntr, nte)]
    return (out, [rs.normal(size=(2, a, d)).astype("f4") for a in ntr]) if views else out


@pytest.mark.parametrize("seed", range(5))
def test_plan_covers_every_client_once_within_its_limits(seed):
    rs = np.random.default_rng(seed)
    ntr = [int(v) for v in np.maximum(1, rs.pareto(1.5, 300) * 50)]
    nte = [int(v) for v in rs.integers(0, 40, 300)]
    cfg = LayoutConfig("bucketed", waste=0.1, bucket_bytes=40_000, bucket_clients=16)
    plan = plan_buckets(ntr, nte, 8, cfg)
    assert sorted(i for b in plan for i in b) == list(range(300))
    assert all(list(b) == sorted(b) for b in plan)
    real = sum(ntr) + sum(max(n, 1) for n in nte)
    held = 0
    for b in plan:
        rows = len(b) * (max(ntr[i] for i in b) + max(max(nte[i] for i in b), 1))
        own = sum(ntr[i] + max(nte[i], 1) for i in b)
        held += rows
        assert len(b) <= 16
        assert len(b) == 1 or (rows <= 1.1 * own and rows * 8 <= 40_000)
    assert held <= 1.1 * real


def test_padded_and_auto_plans():
    assert plan_buckets(SKEWED, [1] * 10, 4, LayoutConfig("padded")) == [tuple(range(10))]
    small = LayoutConfig("auto")  # padding of a few hundred bytes: not worth a call per bucket
    assert not bucketing_pays(SKEWED, [1] * 10, 4, small)
    assert plan_buckets(SKEWED, [1] * 10, 4, small) == [tuple(range(10))]
    big = LayoutConfig("auto", auto_min_bytes=100)
    assert bucketing_pays(SKEWED, [1] * 10, 4, big) and len(plan_buckets(SKEWED, [1] * 10, 4, big)) > 1
    assert not bucketing_pays([10] * 5, [2] * 5, 4, big)  # equal sizes: no padding to save
    with pytest.raises(UserError, match="layout 'packed'"):
        LayoutConfig("packed")


def _same_rows(a: FedData, b: FedData, i: int, j: int) -> None:
    """Client i of `a` and client j of `b` hold the same real rows and nothing else."""
    n, t = a.n_train[i], a.n_test[i]
    assert (n, t) == (b.n_train[j], b.n_test[j])
    assert torch.equal(a.x_train[i, :n], b.x_train[j, :n]) and torch.equal(a.y_train[i, :n], b.y_train[j, :n])
    assert torch.equal(a.x_test[i, :t], b.x_test[j, :t]) and torch.equal(a.y_test[i, :t], b.y_test[j, :t])
    assert int(a.m_train[i].sum()) == n and int(a.m_test[i].sum()) == t
    assert float(a.x_train[i, n:].abs().sum()) == 0.0  # padding rows are zeros


def test_bucketed_from_arrays_holds_the_padded_rows():
    arrs, views = _clients(SKEWED, views=True)
    dense = from_arrays(arrs, 3, train_views=views)
    b = from_arrays(arrs, 3, train_views=views, layout=LayoutConfig("bucketed", waste=0.2))
    assert isinstance(b, BucketedFedData) and len(b.buckets) > 1
    assert b.n_train == dense.n_train and b.client_names == dense.client_names and b.num_clients == 10
    assert torch.equal(b.client_index, torch.arange(10)) and torch.equal(b.class_counts(), dense.class_counts())
    for ms, bucket in b.groups():
        assert bucket.client_index.tolist() == list(ms)  # global ids: the same batches and noise
        for p, i in enumerate(ms):
            _same_rows(bucket, dense, p, i)
            assert torch.equal(bucket.v_train[p, :, : SKEWED[i]], dense.v_train[i, :, : SKEWED[i]])
    info = layout_info(b)
    assert info["name"] == "bucketed" and info["buckets"] == len(b.buckets)
    assert info["feature_bytes"] <= info["held_feature_bytes"] < layout_info(dense)["held_feature_bytes"]


def test_select_across_buckets_equals_padded_select():
    dense = from_arrays(_clients(SKEWED), 3)
    b = to_layout(dense, LayoutConfig("bucketed", waste=0.0))
    for ids in ([8], [2, 8, 0], [9, 5]):
        got, want = b.select(ids), dense.select(ids)
        assert got.x_train.shape == want.x_train.shape and got.client_index.tolist() == ids
        for j in range(len(ids)):
            _same_rows(got, want, j, j)


def test_bucketed_store_load_equals_padded(tmp_path):
    from embedcache.store.importer import import_features

    store = tmp_path / "s.zarr"
    rs = np.random.default_rng(1)
    for k, n in enumerate(SKEWED):
        for split, m in (("train", n), ("test", max(1, n // 3))):
            f = tmp_path / f"c{k}-{split}.npz"
            np.savez(f, features=rs.normal(size=(m, 5)).astype("f4"), labels=rs.integers(0, 3, m))
            import_features(store, f, backbone="bb", client=f"c{k}", split=split, domain="d", classes=["a", "b", "c"])
    dense = load_fed_data(str(store), ["bb"], device="cpu")
    b = load_fed_data(str(store), ["bb"], device="cpu", chunk_rows=7, layout=LayoutConfig("bucketed", waste=0.1),
                      binarize=True)
    assert isinstance(dense, FedData) and isinstance(b, BucketedFedData) and b.client_names == dense.client_names
    for ms, bucket in b.groups():
        for p, i in enumerate(ms):
            assert torch.equal(bucket.x_train[p, : SKEWED[i]], dense.x_train[i, : SKEWED[i]].sign())
    auto = load_fed_data(str(store), ["bb"], device="cpu", layout="auto")  # a few kB of padding: dense
    assert isinstance(auto, FedData)


def test_store_load_opens_the_store_once_whatever_the_clients(tmp_path, monkeypatch):
    """Opening the root group parses the consolidated metadata (which grows with the shards):
    once per client made a 1,000-client load quadratic (minutes); now once per StoreInfo."""
    import pickle

    import embedcache.store.reader as reader
    from embedcache.store.importer import import_features

    store = tmp_path / "s.zarr"
    rs = np.random.default_rng(2)
    for k, n in enumerate(SKEWED):
        for split, m in (("train", n), ("test", 2)):
            f = tmp_path / f"c{k}-{split}.npz"
            np.savez(f, features=rs.normal(size=(m, 3)).astype("f4"), labels=rs.integers(0, 2, m))
            import_features(store, f, backbone="bb", client=f"c{k}", split=split, domain="d", classes=["a", "b"])
    import embedcache.store.layout as layout

    opened, parsed = [], []
    real, real_meta = layout.zarr_root, reader.root_metadata
    monkeypatch.setattr(layout, "zarr_root", lambda *a: opened.append(a) or real(*a))
    monkeypatch.setattr(reader, "root_metadata", lambda *a: parsed.append(a) or real_meta(*a))
    data = load_fed_data(str(store), ["bb"], device="cpu", chunk_rows=3)
    # was 2 zarr opens per client; the metadata is now read once, as JSON, and no zarr group is opened
    assert data.num_clients == len(SKEWED) and len(parsed) == 1 and not opened, (parsed, opened)
    info = reader.open_store(str(store))
    assert info.shard("bb", "c3", "test").n == 2 and info.shard("bb", "c3", "nope") is None
    back = pickle.loads(pickle.dumps(info))  # dask ships StoreInfos: the caches stay behind
    assert back == info and "_nodes" not in back.__dict__ and back.shard("bb", "c1", "train").n == SKEWED[1]


def test_count_parameters_is_the_same_in_both_layouts():
    dense = from_arrays(_clients(SKEWED), 3)
    b = to_layout(dense, LayoutConfig("bucketed"))
    for make in (lambda: FedPCL(FedPCLConfig(hidden=4)), lambda: HeadTuning(LPConfig(init="fedncm"))):
        assert count_parameters(make(), b) == count_parameters(make(), dense)


def test_owned_copies_only_shared_or_expanded_leaves():
    base = torch.zeros(3, 2)
    server = {"w": base}
    state = {"a": base, "b": torch.ones(3, 2), "c": torch.ones(2).expand(3, 2)}
    out = owned(state, server)
    assert out["b"] is state["b"]  # nothing else holds it: updated in place, no copy
    assert out["a"] is not base and torch.equal(out["a"], base)
    assert out["c"].is_contiguous()


def test_rows_of_a_state_are_views_only_when_consecutive():
    state = {"w": torch.arange(24.0).view(6, 4), "n": (torch.arange(6),)}
    assert row_range([2, 3, 4]) == (2, 5) and row_range([2, 4]) is None and row_range([]) is None
    view, copy = tree_rows(state, [2, 3, 4]), tree_rows(state, [4, 1])
    assert view["w"].data_ptr() == state["w"][2].data_ptr()  # no copy
    assert copy["w"].data_ptr() != state["w"].data_ptr()
    torch.testing.assert_close(copy["w"], state["w"][[4, 1]])
    torch.testing.assert_close(copy["n"][0], torch.tensor([4, 1]))
    for ids in ([2, 3, 4], [4, 1], [0]):
        new = {"w": -torch.ones(len(ids), 4), "n": (torch.full((len(ids),), -1),)}
        a = {"w": state["w"].clone(), "n": (state["n"][0].clone(),)}
        b = {"w": state["w"].clone(), "n": (state["n"][0].clone(),)}
        tree_put_rows_(a, ids, new)
        tree_scatter_(b, torch.tensor(ids), new)
        torch.testing.assert_close(a, b)
    same = tree_rows(state, [1, 2])  # a part that is the slice itself: written back unchanged
    before = state["w"].clone()
    tree_put_rows_(state, [1, 2], same)
    torch.testing.assert_close(state["w"], before)


def test_writing_back_rows_survives_a_result_that_views_another_field():
    """A pure client_update may hand an input field back under another name (prev = cs.cur) or in
    its message: with views of the state, both must still hold the value from before the write."""
    from fedheads.core.tree import unshared

    state = {"cur": torch.zeros(6, 2), "prev": torch.full((6, 2), -1.0)}
    rows = [1, 2, 3]
    cs = tree_rows(state, rows)
    new = {"cur": cs["cur"] + 1, "prev": cs["cur"]}
    msg = unshared({"sent": cs["cur"]}, state)
    tree_put_rows_(state, rows, new)
    torch.testing.assert_close(state["cur"][1:4], torch.ones(3, 2))
    torch.testing.assert_close(state["prev"][1:4], torch.zeros(3, 2))
    torch.testing.assert_close(msg["sent"], torch.zeros(3, 2))


def test_parts_streamed_into_one_tree_equal_their_concatenation():
    parts = [({"p": torch.randn(k, 3)}, torch.randn(k)) for k in (2, 2, 1)]
    starts = [0, 2, 4]
    got = tree_cat_chunks(((a, p) for a, p in zip(starts, parts)), 5)
    torch.testing.assert_close(got, tree_cat(parts))
    with pytest.raises(ValueError):
        tree_cat_chunks(iter(()), 0)


def test_the_engine_trains_consecutive_buckets_on_views_of_the_state(monkeypatch):
    """Largest-first buckets: client_update gets views of the federation's state (no bucket copy)."""
    ordered = from_arrays(_clients(SKEWED), 3).by_size()[0]
    data = to_layout(ordered, LayoutConfig("bucketed", waste=0.5, bucket_clients=3))
    assert isinstance(data, BucketedFedData) and len(data.buckets) > 1
    seen = []
    real = FedPCL.client_update
    monkeypatch.setattr(FedPCL, "client_update",
                        lambda self, cs, *a: seen.append(cs.params["proj.weight"]._base is not None) or real(self, cs, *a))
    run(FedPCL(FedPCLConfig(hidden=8, batch_size=4)), data, rounds=2, seed=0, progress=False)
    assert seen and all(seen)


def test_scratch_pool_serves_every_bucket_from_one_buffer():
    with ops.buffer_pool() as pool:
        big = ops.scratch("g", torch.empty(8, 3, 2))
        small = ops.scratch("g", torch.empty(5, 3, 2))
        assert small.shape == (5, 3, 2) and small.is_contiguous() and small.data_ptr() == big.data_ptr()
        grown = ops.scratch("g", torch.empty(9, 3, 2))
        assert grown.shape == (9, 3, 2)
        other = ops.scratch("g", torch.empty(5, 2, 3))  # another trailing shape: its own buffer
        assert other.data_ptr() != grown.data_ptr()
        assert len(pool) == 2


def test_train_records_the_layout_and_agrees_with_padded(tmp_path):
    from fedheads.cli import main

    store = skewed_store(tmp_path)
    res = {}
    for layout in ("padded", "bucketed"):
        out = tmp_path / layout
        r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "bb", "--algorithm", "lp",
                                      "--rounds", "2", "--seeds", "0", "--layout", layout, "--quiet", "--out", str(out)],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        res[layout] = json.loads((out / "results.json").read_text())
    assert res["padded"]["layout"]["name"] == "padded" and res["padded"]["layout"]["buckets"] == 1
    assert res["bucketed"]["layout"]["name"] == "bucketed" and res["bucketed"]["layout"]["buckets"] > 1
    for c, v in res["padded"]["per_client"].items():
        assert res["bucketed"]["per_client"][c]["mean"] == pytest.approx(v["mean"], abs=1e-9)
