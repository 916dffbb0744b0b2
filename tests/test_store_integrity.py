"""Store integrity (contract 4): names unique under casefold, consolidated metadata that is
damaged or stale, and chunks deleted or changed behind the writer's back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from store_doubles import assert_one_line

from embedcache.cli import main as ec
from embedcache.errors import StoreWarning, UserError
from embedcache.store import writer as st
from embedcache.store.importer import import_features
from embedcache.store.maintenance import verify_store
from embedcache.store.reader import iter_split_chunks, load_split, open_store
from fedheads.cli import main as fh

CLASSES = ["x", "y", "z"]


def _store(root: Path, clients=("c0", "c1"), n: int = 20, d: int = 6, chunk_rows: int = 8) -> Path:
    """A small imported store: every client has train and test, labels 0..2."""
    rng = np.random.default_rng(0)
    store = root / "s"
    for c in clients:
        for split in ("train", "test"):
            y = np.arange(n) % 3
            x = (rng.normal(size=(n, d)) + 2 * y[:, None]).astype(np.float32)
            f = root / f"{c}-{split}.npz"
            np.savez(f, features=x, labels=y)
            import_features(store, f, backbone="bb", client=c, split=split, classes=CLASSES, chunk_rows=chunk_rows)
    return store


def _train(store: Path, out: Path):
    return CliRunner().invoke(fh, ["train", "--store", str(store), "--backbones", "bb", "--algorithm", "fedncm",
                                   "--rounds", "1", "--seeds", "0", "--quiet", "--out", str(out)])


def _edit_root(store: Path, fn) -> None:
    meta = json.loads((store / "zarr.json").read_text())
    fn(meta)
    (store / "zarr.json").write_text(json.dumps(meta))


# -- names that differ only in letter case -------------------------------------------------------

def test_case_colliding_client_is_refused_and_the_store_stays_readable(tmp_path):
    store = _store(tmp_path, clients=("Caltech10",))
    np.savez(tmp_path / "f.npz", features=np.ones((4, 6), np.float32), labels=np.array([0, 1, 2, 0]))
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    res = CliRunner().invoke(ec, ["import", "--store", str(store), "--backbone", "bb", "--client", "caltech10",
                                  "--split", "train", str(tmp_path / "f.npz")])
    assert_one_line(res, 2, "client caltech10: collides with existing client Caltech10", "letter case")
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before
    assert open_store(store).clients == ("Caltech10",) and verify_store(store) == []
    assert load_split(store, "bb", "train")["Caltech10"].features.shape == (20, 6)
    # a backbone whose group differs only in case, or shares the group of another name
    res = CliRunner().invoke(ec, ["import", "--store", str(store), "--backbone", "BB", "--client", "Caltech10",
                                  "--split", "train", str(tmp_path / "f.npz")])
    assert_one_line(res, 2, "backbone BB: its group BB collides with existing group bb")
    with pytest.raises(UserError, match="group b_b already holds backbone b:b"):
        import_features(store, tmp_path / "f.npz", backbone="b:b", client="Caltech10", split="train")
        import_features(store, tmp_path / "f.npz", backbone="b_b", client="Caltech10", split="train")
    # an extraction's client list (init_store) is checked against itself and the store
    with pytest.raises(UserError, match="client caltech10: collides with existing client Caltech10"):
        st.init_store(store, CLASSES, "m2", clients=["caltech10"])
    with pytest.raises(UserError, match="client A: collides with client a "):
        st.init_store(tmp_path / "new", CLASSES, "m", clients=["a", "A"])
    assert not (tmp_path / "new").exists()
    assert json.loads((store / "zarr.json").read_text())["attributes"]["clients"] == ["Caltech10"]


def test_a_store_that_already_holds_case_colliding_names_still_opens(tmp_path):
    """Left by older versions: zarr cannot nest their consolidated metadata, the reader (which
    reads it as JSON, not through zarr) can, and without a warning."""
    import warnings

    store = _store(tmp_path, clients=("Ab", "c1"))
    shutil.copytree(store / "bb" / "c1", store / "bb" / "aB")
    _edit_root(store, lambda m: m["attributes"].update(clients=["Ab", "aB", "c1"]))
    st.consolidate(store)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreWarning)
        info = open_store(store)
    assert info.clients == ("Ab", "aB", "c1") and info.consolidated
    assert sorted(load_split(info, "bb", "test")) == ["Ab", "aB", "c1"]
    assert any("clients Ab and aB differ only in letter case" in p for p in verify_store(store))


# -- consolidated metadata that does not match the files -----------------------------------------

@pytest.mark.parametrize("damage", ["garbage-entry", "not-a-dict", "lists-a-ghost"])
def test_damaged_consolidated_metadata_is_bypassed_with_one_note(tmp_path, damage):
    store = _store(tmp_path)

    def hurt(meta):
        entries = meta["consolidated_metadata"]["metadata"]
        if damage == "garbage-entry":
            entries["bb/c0"] = "garbage"
        elif damage == "not-a-dict":
            meta["consolidated_metadata"] = 17
        else:
            entries["bb/c9/train"] = entries["bb/c0/train"]
    _edit_root(store, hurt)
    res = _train(store, tmp_path / "run")
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "consolidated metadata is" in notes[0] and "verify --repair" in notes[0], res.output
    assert (tmp_path / "run" / "results.json").is_file()
    res = CliRunner().invoke(ec, ["verify", str(store)])
    assert res.exit_code == 1 and "consolidated metadata" in res.output, res.output
    res = CliRunner().invoke(ec, ["verify", "--repair", str(store)])
    assert res.exit_code == 0 and "repaired: consolidated metadata" in res.output, res.output
    assert st.has_consolidated(store) and open_store(store).consolidated


def test_a_shard_deleted_by_hand_is_not_listed_and_verify_reports_the_stale_metadata(tmp_path):
    store = _store(tmp_path)
    shutil.rmtree(store / "bb" / "c1" / "train")
    with pytest.warns(StoreWarning, match=r"is stale \(lists bb/c1/train, gone from disk\)"):
        info = open_store(store)
    assert "bb/c1/train" not in [s.path for s in info.shards]
    rep = json.loads(CliRunner().invoke(ec, ["inspect", "--json", str(store)]).stdout)
    assert "bb/c1/train" not in [s["shard"] for s in rep["shards"]] and len(rep["shards"]) == 3
    assert verify_store(store) == [f"{store}: consolidated metadata lists bb/c1/train, which is not on disk; "
                                   "`embedcache verify --repair` rewrites it"]
    with pytest.raises(UserError, match="bb/c1/train: shard missing"):
        load_split(store, "bb", "train")
    # a write rewrites it: re-importing the shard is the repair the user would do
    import_features(store, tmp_path / "c1-train.npz", backbone="bb", client="c1", split="train")
    assert verify_store(store) == [] and st.has_consolidated(store)


# -- chunks deleted or changed behind the writer's back -----------------------------------------

def test_a_deleted_feature_chunk_is_refused_on_every_read_path(tmp_path):
    store = _store(tmp_path)
    (store / "bb" / "c1" / "train" / "features" / "c" / "1" / "0").unlink()  # rows 8..15 now read as zeros
    with pytest.raises(UserError, match=r"bb/c1/train chunk 1: data missing or changed since it was written"):
        load_split(store, "bb", "train")
    with pytest.raises(UserError, match="bb/c1/train chunk 1: data missing"):
        list(iter_split_chunks(store, "bb", "train", "c1", chunk_rows=5))
    assert load_split(store, "bb", "train", clients=["c0"])["c0"].features.shape == (20, 6)
    assert_one_line(_train(store, tmp_path / "run"), 2, "error: bb/c1/train chunk 1: data missing or changed",
              "embedcache verify")
    assert not (tmp_path / "run" / "results.json").exists()
    assert verify_store(store) == ["bb/c1/train: chunk 1 sha256 mismatch"]
    res = CliRunner().invoke(ec, ["export", "--store", str(store), "--out", str(tmp_path / "e.h5")])
    assert_one_line(res, 2, "chunk 1: data missing")


def test_deleted_labels_or_changed_ids_are_refused_too(tmp_path):
    store = _store(tmp_path)
    (store / "bb" / "c0" / "test" / "labels" / "c" / "2").unlink()  # labels of rows 16..19 read as 0
    with pytest.raises(UserError, match="bb/c0/test chunk 2: data missing"):
        load_split(store, "bb", "test")
    assert verify_store(store) == ["bb/c0/test: chunk 2 labels or sample ids changed (rows sha256 mismatch)"]
    ids = st.open_shard(store, "bb", "c1", "test")["sample_ids"]
    ids[0] = "someone-else"
    with pytest.raises(UserError, match="bb/c1/test chunk 0: data missing"):
        load_split(store, "bb", "test", clients=["c1"])


def test_an_all_zero_chunk_that_zarr_never_wrote_is_not_a_false_alarm(tmp_path):
    x = np.ones((9, 2), np.float32)
    x[3:6] = 0  # chunk 1 equals the fill value: zarr writes no file for it
    np.savez(tmp_path / "z.npz", features=x, labels=np.zeros(9, int))
    import_features(tmp_path / "s", tmp_path / "z.npz", backbone="bb", client="c", split="train", chunk_rows=3)
    assert not (tmp_path / "s" / "bb" / "c" / "train" / "features" / "c" / "1").exists()
    np.testing.assert_array_equal(load_split(tmp_path / "s", "bb", "train")["c"].features, x)
    got = np.concatenate([f for f, _, _ in iter_split_chunks(tmp_path / "s", "bb", "train", "c", chunk_rows=2)])
    np.testing.assert_array_equal(got, x)


def _views_store(root: Path, legacy: bool = False) -> Path:
    spec = st.ShardSpec(backbone="v", weights_sha256="w", preprocess={}, feature_dim=2, client="c", split="train",
                        domain="d", manifest_hash="m", sample_list_hash="s", sample_ids=tuple("abcde"),
                        labels=(0, 1, 0, 1, 0), views=2, chunk_rows=2)
    st.init_store(root, ["p", "q"], "m", clients=["c"])
    x = np.arange(10, dtype=np.float32).reshape(5, 2) + 1
    st.write_shard(root, spec, x, views=np.stack([x + 100, x + 200]))
    if legacy:  # finalised before features_sha256 existed
        del st.open_shard(root, "v", "c", "train").attrs["features_sha256"]
    st.consolidate(root)
    return root


@pytest.mark.parametrize("legacy", [False, True])
def test_a_views_shard_is_checked_with_or_without_its_views(tmp_path, legacy):
    store = _views_store(tmp_path / "s", legacy)
    assert ("features_sha256" in st.open_shard(store, "v", "c", "train", "r").attrs) is not legacy
    (store / "v" / "c" / "train" / "views" / "c" / "0" / "1" / "0").unlink()
    with pytest.raises(UserError, match="v/c/train chunk 1: data missing"):
        load_split(store, "v", "train", views=True)
    if legacy:  # the views are read to check chunk_sha256
        with pytest.raises(UserError, match="chunk 1: data missing"):
            load_split(store, "v", "train")
    else:  # the features alone are intact and checked with features_sha256
        assert load_split(store, "v", "train")["c"].features[2, 0] == 5
    (store / "v" / "c" / "train" / "features" / "c" / "2" / "0").unlink()
    with pytest.raises(UserError, match="chunk [12]: data missing"):
        list(iter_split_chunks(store, "v", "train", "c", chunk_rows=3))


def test_iter_split_chunks_reads_each_stored_chunk_once_across_misaligned_blocks(tmp_path, monkeypatch):
    from embedcache.store import checked_reads as shard_check

    store = _store(tmp_path, clients=("c0",), n=21, chunk_rows=4)
    calls = []
    real = shard_check.ShardReader.read
    monkeypatch.setattr(shard_check.ShardReader, "read", lambda self, a, b: calls.append((a, b)) or real(self, a, b))
    got = list(iter_split_chunks(store, "bb", "train", "c0", chunk_rows=5))
    want = load_split(store, "bb", "train")["c0"]
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), want.features)
    assert [len(g[1]) for g in got] == [5, 5, 5, 5, 1]
    assert np.concatenate([g[2] for g in got]).tolist() == want.sample_ids.tolist()
    stream = calls[:-1]  # the last call is load_split's
    assert [c for a, b in stream for c in range(a, b)] == list(range(6))  # every chunk once, in order


def test_the_read_check_benchmark_runs(tmp_path):
    """benchmarks/bench_store_read.py --quick: checked and unchecked reads of one store."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "benchmarks")])}
    res = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_store_read.py"), "--quick"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["ratio_checked_over_unchecked"] > 0 and out["feature_bytes"] == 2 * 2000 * 64 * 4


def test_a_group_where_an_array_belongs_is_a_problem_not_a_crash(tmp_path):
    """verify names a shard whose labels array was replaced by a group; the writer's readers
    refuse it with one line instead of an AttributeError deep in zarr."""
    import zarr

    from embedcache.store.layout import read

    store = _store(tmp_path, clients=("c0",))
    shard_dir = store / "bb" / "c0" / "train"
    shutil.rmtree(shard_dir / "labels")
    zarr.open_group(str(shard_dir / "labels"), mode="w", zarr_format=3)
    assert "bb/c0/train: labels is a group, not an array" in verify_store(store)
    shard = st.open_shard(store, "bb", "c0", "train", mode="r")
    with pytest.raises(UserError, match="labels: a group where an array was expected"):
        read(shard, "labels")
