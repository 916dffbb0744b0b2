"""The streamed layout (fedheads/core/federation.py StreamedFedData): the bucketed plan with each
bucket read when a call needs it. Every registered algorithm gives the bucketed layout's run bit
for bit; the engine holds at most two buckets at once; `fedheads train --layout streamed` reads
the store as it goes, records the layout and resumes; what it cannot do is refused in one line."""

from __future__ import annotations

import json
import weakref

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from fed_tiny import tiny_fed
from store_doubles import SKEWED, skewed_store

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm, list_algorithms
from fedheads.core import run
from fedheads.core.federation import (
    BucketedFedData,
    FedData,
    LayoutConfig,
    StreamedFedData,
    layout_info,
    to_layout,
)
from fedheads.core.tree import tree_leaves
from fedheads.run.load import from_arrays, load_fed_data

# as tests/test_engine_equivalence.py: buckets of at most 2 clients that interleave the client order
PLAN = {"waste": 1.0, "bucket_clients": 2}


class Reads:
    """Wraps a StreamedFedData's bucket reader: counts reads and the most buckets alive at once."""

    def __init__(self, data: StreamedFedData) -> None:
        self.inner, self.reads, self.test_only, self.alive, self.most = data.read_bucket, 0, 0, [], 0

    def __call__(self, b: int, train: bool) -> FedData:
        out = self.inner(b, train)
        assert (out.x_train.shape[1] == 0) == (not train)
        self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(out.x_test)]
        self.reads, self.most = self.reads + 1, max(self.most, len(self.alive))
        self.test_only += not train
        return out


def streamed(data: FedData) -> tuple[StreamedFedData, Reads]:
    s = to_layout(data, LayoutConfig("streamed", **PLAN))
    assert isinstance(s, StreamedFedData)
    reads = Reads(s)
    object.__setattr__(s, "read_bucket", reads)
    return s, reads


def assert_same_run(a, b) -> None:
    assert len(a.history) == len(b.history)
    for ra, rb in zip(a.history, b.history):
        assert ra.participants == rb.participants and ra.comm == rb.comm
        assert (ra.accuracy is None) == (rb.accuracy is None)
        for k in ra.accuracy or {}:
            assert torch.equal(ra.accuracy[k].nan_to_num(-1), rb.accuracy[k].nan_to_num(-1)), k
    la, lb = tree_leaves((a.client_state, a.server_state)), tree_leaves((b.client_state, b.server_state))
    assert len(la) == len(lb)
    for i, (ta, tb) in enumerate(zip(la, lb)):
        assert torch.equal(ta, tb), f"leaf {i}"


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(i.name for i in list_algorithms()))
def test_every_registered_algorithm_streams_as_it_runs_bucketed(name: str, fraction: float) -> None:
    """Registry-wide, default configurations, clients stored largest first (as `fedheads train`
    loads them) and in mixed order: the streamed run is the bucketed run bit for bit, and no more
    than two buckets are alive at once (the one in use and the next being read)."""
    for data in (tiny_fed(M=6).by_size()[0], tiny_fed(M=6)):
        bucketed = to_layout(data, LayoutConfig("bucketed", **PLAN))
        assert isinstance(bucketed, BucketedFedData) and len(bucketed.buckets) == 3
        s, reads = streamed(data)
        a = run(create_algorithm(name), s, rounds=3, seed=3, fraction=fraction, progress=False)
        b = run(create_algorithm(name), bucketed, rounds=3, seed=3, fraction=fraction, progress=False)
        assert_same_run(a, b)
        assert reads.reads >= 3 and reads.most <= 2, (reads.reads, reads.most)


def test_a_one_pass_head_reads_each_bucket_for_its_round_and_its_evaluation() -> None:
    """The round reads every bucket whole, the evaluation only their test splits."""
    s, reads = streamed(tiny_fed(M=6))
    run(create_algorithm("fed3r"), s, rounds=1, progress=False)
    assert reads.test_only == len(s.members)
    assert reads.reads <= 2 * len(s.members) + 1  # the round, the evaluation, and one message-size probe


def test_streamed_from_arrays_and_its_record() -> None:
    rs = np.random.default_rng(0)
    arrs = [(rs.normal(size=(n, 4)).astype("f4"), rs.integers(0, 3, n), rs.normal(size=(2, 4)).astype("f4"),
             rs.integers(0, 3, 2)) for n in SKEWED]
    cfg = LayoutConfig("streamed", waste=0.1)
    s = from_arrays(arrs, 3, layout=cfg)
    b = from_arrays(arrs, 3, layout=LayoutConfig("bucketed", waste=0.1))
    assert isinstance(s, StreamedFedData) and isinstance(b, BucketedFedData)
    assert s.members == b.members and s.shapes == b.shapes and s.spec() == b.spec()
    for (_, got), want in zip(s.groups(), b.buckets):
        for f in ("x_train", "y_train", "m_train", "x_test", "y_test", "m_test", "client_index"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert torch.equal(s.select([8, 0, 5]).x_train, b.select([8, 0, 5]).x_train)
    assert torch.equal(s.class_counts(), b.class_counts())
    info, held = layout_info(s), layout_info(b)
    assert info["name"] == "streamed" and info["buckets"] == held["buckets"]
    assert info["padding_multiple"] == held["padding_multiple"]
    assert info["held_feature_bytes"] < held["held_feature_bytes"]  # one bucket, not all of them


def test_what_streaming_cannot_do_is_refused_in_one_line() -> None:
    s, _ = streamed(tiny_fed(M=6))
    with pytest.raises(UserError, match="layout streamed: the loop engine"):
        run(create_algorithm("fedncm"), s, rounds=1, engine="loop", progress=False)
    rs = np.random.default_rng(0)
    arrs = [(rs.normal(size=(3, 4)).astype("f4"), rs.integers(0, 3, 3), rs.normal(size=(2, 4)).astype("f4"),
             rs.integers(0, 3, 2))] * 2
    with pytest.raises(UserError, match="views are not streamed"):
        from_arrays(arrs, 3, train_views=[rs.normal(size=(2, 3, 4)).astype("f4")] * 2, layout="streamed")


def test_store_buckets_are_the_bucketed_loads(tmp_path) -> None:
    store = skewed_store(tmp_path)
    s = load_fed_data(str(store), ["bb"], device="cpu", chunk_rows=7, layout=LayoutConfig("streamed", waste=0.1),
                      binarize=True)
    b = load_fed_data(str(store), ["bb"], device="cpu", layout=LayoutConfig("bucketed", waste=0.1), binarize=True)
    assert isinstance(s, StreamedFedData) and isinstance(b, BucketedFedData) and s.members == b.members
    for (_, got), want in zip(s.groups(), b.buckets):
        assert torch.equal(got.x_train, want.x_train) and torch.equal(got.client_index, want.client_index)
    for (_, got), want in zip(s.groups(train=False), b.buckets):  # the evaluation's reads: the test split only
        assert got.x_train.shape == (want.num_clients, 0, 6) and got.n_train == want.n_train
        for f in ("x_test", "y_test", "m_test", "client_index"):
            assert torch.equal(getattr(got, f), getattr(want, f)), f
    assert s.identity and s.identity.endswith(":sign")
    with pytest.raises(UserError, match="views are not streamed"):
        load_fed_data(str(store), ["bb"], device="cpu", views=True, layout="streamed")


def test_identity_names_the_features(tmp_path) -> None:
    """Two stores of the same shape and different features have different identities (a resume
    compares them), and the same store read twice has the same."""
    a, b = skewed_store(tmp_path / "a", seed=2), skewed_store(tmp_path / "b", seed=3)
    ia = load_fed_data(str(a), ["bb"], device="cpu", layout="streamed").identity
    assert ia == load_fed_data(str(a), ["bb"], device="cpu", layout="streamed").identity
    assert ia != load_fed_data(str(b), ["bb"], device="cpu", layout="streamed").identity


def test_train_streamed_equals_bucketed_and_resumes(tmp_path) -> None:
    from fedheads.cli import main

    store = skewed_store(tmp_path)
    res = {}
    for layout in ("bucketed", "streamed"):
        out = tmp_path / layout
        r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "bb", "--algorithm", "lp",
                                      "--rounds", "2", "--seeds", "0", "--layout", layout, "--quiet", "--out", str(out)],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        res[layout] = json.loads((out / "results.json").read_text())
    assert res["streamed"]["layout"]["name"] == "streamed"
    assert res["streamed"]["layout"]["buckets"] == res["bucketed"]["layout"]["buckets"] > 1
    for c, v in res["bucketed"]["per_client"].items():
        assert res["streamed"]["per_client"][c]["mean"] == v["mean"]
    # resume from the checkpoint of a finished run: the same result, no data checksum needed
    r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "bb", "--algorithm", "lp",
                                  "--rounds", "2", "--seeds", "0", "--layout", "streamed", "--quiet", "--resume",
                                  "--out", str(tmp_path / "streamed")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    again = json.loads((tmp_path / "streamed" / "results.json").read_text())
    assert again["per_client"] == res["streamed"]["per_client"]


def test_a_streamed_load_refuses_what_its_reads_would_before_the_run(tmp_path) -> None:
    """Unknown backbones and missing shards are refused when the layout is made, as a full load
    refuses them, not at the first bucket read inside a round."""
    import shutil

    store = skewed_store(tmp_path)
    with pytest.raises(UserError, match="nosuch"):
        load_fed_data(str(store), ["nosuch"], device="cpu", layout="streamed")
    from embedcache.store.reader import open_store

    sh = open_store(store).shard("bb", "c3", "test")
    shutil.rmtree(store / sh.path)
    for layout in ("bucketed", "streamed"):
        with pytest.raises(UserError, match="c3"):
            load_fed_data(str(store), ["bb"], device="cpu", layout=layout)


def test_auto_streams_when_the_features_would_not_fit(tmp_path, monkeypatch, capsys) -> None:
    """`auto` holds the features while they take at most half the memory available, and streams
    them (one note line) when they would take more: a store larger than memory still trains."""
    import fedheads.run.load as load

    store = skewed_store(tmp_path)
    monkeypatch.setattr(load, "available_memory", lambda device: 1 << 40)
    assert not isinstance(load_fed_data(str(store), ["bb"], device="cpu", layout="auto"), StreamedFedData)
    assert "note:" not in capsys.readouterr().err
    monkeypatch.setattr(load, "available_memory", lambda device: 4096)
    s = load_fed_data(str(store), ["bb"], device="cpu", layout="auto")
    assert isinstance(s, StreamedFedData)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "note: the features" in err and "--layout streamed" in err
    monkeypatch.setattr(load, "available_memory", lambda device: None)  # cannot be told: held as before
    assert not isinstance(load_fed_data(str(store), ["bb"], device="cpu", layout="auto"), StreamedFedData)
    b = load_fed_data(str(store), ["bb"], device="cpu", layout="bucketed")  # an explicit layout is kept
    assert isinstance(b, BucketedFedData)
    assert load.available_memory(torch.device("cpu")) is None or load.available_memory(torch.device("cpu")) > 0


def _arrays() -> dict[str, tuple]:
    rs = np.random.default_rng(0)
    return {f"c{i}": (rs.normal(size=(n, 4)).astype("f4"), rs.integers(0, 3, n), rs.normal(size=(3, 4)).astype("f4"),
                      rs.integers(0, 3, 3)) for i, n in enumerate(SKEWED)}


def test_api_train_on_arrays_runs_the_layout_it_is_given() -> None:
    import fedheads.api as api

    for layout in ("bucketed", "streamed"):
        r = api.train(_arrays(), "fedncm", layout=layout, rounds=1, seeds=[0], device="cpu")
        assert r["layout"]["name"] == layout, (layout, r["layout"])


def test_an_auto_run_resumes_when_auto_would_now_stream(tmp_path, monkeypatch) -> None:
    """auto's choice depends on the memory available: a resumed run keeps the layout its checkpoints name."""
    import fedheads.run.load as load
    from fedheads.cli import main

    store, out = skewed_store(tmp_path), tmp_path / "run"
    args = ["train", "--store", str(store), "--backbones", "bb", "--algorithm", "lp", "--rounds", "2",
            "--seeds", "0", "--quiet", "--out", str(out)]
    monkeypatch.setattr(load, "available_memory", lambda device: 1 << 40)  # held
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    first = json.loads((out / "results.json").read_text())
    monkeypatch.setattr(load, "available_memory", lambda device: 4096)  # auto would stream now
    r = CliRunner().invoke(main, [*args, "--resume"])
    assert r.exit_code == 0, r.output  # the checkpoint's layout is kept, not chosen again
    assert json.loads((out / "results.json").read_text())["per_client"] == first["per_client"]
    streamed_out = tmp_path / "streamed-run"  # and the other way: a run auto streamed, resumed with memory to spare
    args = [*args[:-1], str(streamed_out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert json.loads((streamed_out / "results.json").read_text())["layout"]["name"] == "streamed"
    monkeypatch.setattr(load, "available_memory", lambda device: 1 << 40)
    r = CliRunner().invoke(main, [*args, "--resume"])
    assert r.exit_code == 0, r.output
    assert json.loads((streamed_out / "results.json").read_text())["layout"]["name"] == "streamed"


def test_a_one_bucket_plan_streams_as_it_runs_bucketed_with_reorder() -> None:
    """A plan of one bucket is a padded FedData in the bucketed layout, which the engine stacks
    largest first under reorder=True (as `fedheads train/compare` run it): streamed, that bucket is
    read whole and stacked the same way, so the sums over clients run in the same order."""
    data = tiny_fed(M=6)  # clients not stored largest first
    plan = {"waste": 100.0, "bucket_clients": 64}
    bucketed = to_layout(data, LayoutConfig("bucketed", **plan))
    s = to_layout(data, LayoutConfig("streamed", **plan))
    assert isinstance(bucketed, FedData) and isinstance(s, StreamedFedData) and len(s.members) == 1
    for name in ("fedavg", "fed3r"):
        a = run(create_algorithm(name), s, rounds=2, seed=3, progress=False, reorder=True)
        b = run(create_algorithm(name), bucketed, rounds=2, seed=3, progress=False, reorder=True)
        assert_same_run(a, b)


def test_streamed_with_the_loop_engine_is_refused_before_the_old_run_is_touched(tmp_path) -> None:
    """`--layout streamed --engine loop` is refused in one line before `--overwrite` removes the old run."""
    from fedheads.cli import main

    store = skewed_store(tmp_path)
    for cmd, alg in (("train", ["--algorithm", "lp"]), ("compare", ["--algorithms", "lp,fedncm"])):
        out = tmp_path / cmd
        base = [cmd, "--store", str(store), "--backbones", "bb", *alg, "--rounds", "1", "--seeds", "0", "--quiet",
                "--out", str(out)]
        assert CliRunner().invoke(main, base).exit_code == 0
        r = CliRunner().invoke(main, [*base, "--overwrite", "--layout", "streamed", "--engine", "loop"])
        assert r.exit_code != 0 and "layout streamed: the loop engine" in r.output
        assert (out / "results.json").exists(), cmd


def test_a_shard_reimported_during_a_streamed_run_is_named_as_changed_not_damaged(tmp_path) -> None:
    """A shard imported again (same rows, new features) after the plan was made: the bucket's read
    is refused as a store changed during the run, not as damage (`embedcache verify` finds the store
    healthy, so its advice would mislead)."""
    from embedcache.store.importer import import_features

    store = skewed_store(tmp_path)
    s = load_fed_data(str(store), ["bb"], device="cpu", layout="streamed")
    rs = np.random.default_rng(9)
    np.savez(tmp_path / "new.npz", features=rs.normal(size=(SKEWED[3], 6)).astype("f4"),
             labels=rs.integers(0, 3, SKEWED[3]))
    import_features(store, tmp_path / "new.npz", backbone="bb", client="c3", split="train", domain="d",
                    classes=["a", "b", "c"])
    with pytest.raises(UserError, match="bb/c3/train: extracted or imported again since this run opened the store"):
        for _ in s.groups():
            pass


def test_damage_found_during_a_streamed_run_is_named_as_damage(tmp_path) -> None:
    """Bytes changed under a shard whose metadata did not change: the reader's damage line."""
    store = skewed_store(tmp_path)
    s = load_fed_data(str(store), ["bb"], device="cpu", layout="streamed")
    chunk = next(p for p in sorted((store / "bb" / "c8" / "train" / "features").rglob("*")) if p.is_file()
                 and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[-3] ^= 0x01
    chunk.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="bb/c8/train chunk 0: data missing or changed since it was written"):
        for _ in s.groups():
            pass
