"""Store writer: keys, chunk digests, completion, rebuild on key change, import/export/verify/inspect."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from embedcache.cli import main
from embedcache.errors import UserError
from embedcache.store import writer as st
from embedcache.store.maintenance import verify_store
from embedcache.store.reader import load_split, open_store


def _spec(n: int = 7, d: int = 3, **kw) -> st.ShardSpec:
    base = dict(backbone="bb/x:1", weights_sha256="w" * 64, preprocess={"size": 8}, feature_dim=d, client="c0",
                split="train", domain="dom", manifest_hash="m", sample_list_hash="s",
                sample_ids=tuple(f"id{i}" for i in range(n)), labels=tuple(i % 2 for i in range(n)), chunk_rows=3)
    base.update(kw)
    return st.ShardSpec(**base)


def _write_all(store: Path, spec: st.ShardSpec, feats: np.ndarray) -> None:
    st.init_store(store, ["a", "b"], "m")
    st.write_shard(store, spec, feats)
    st.consolidate(store)


def test_backbone_key_and_cache_key():
    assert st.backbone_key("timm:vit_small/16 ü") == "timm_vit_small_16__"
    k = st.cache_key("b", "w", {"a": 1, "b": 2}, "s", 1, "float32")
    assert k == st.cache_key("b", "w", {"b": 2, "a": 1}, "s", 1, "float32")  # canonical JSON
    for changed in (("b2", "w", {"a": 1, "b": 2}, "s", 1, "float32"), ("b", "w2", {"a": 1, "b": 2}, "s", 1, "float32"),
                    ("b", "w", {"a": 1}, "s", 1, "float32"), ("b", "w", {"a": 1, "b": 2}, "s2", 1, "float32"),
                    ("b", "w", {"a": 1, "b": 2}, "s", 2, "float32"), ("b", "w", {"a": 1, "b": 2}, "s", 1, "float16")):
        assert st.cache_key(*changed) != k


def test_roundtrip_layout_and_attrs(tmp_path):
    spec = _spec()
    feats = np.arange(21, dtype=np.float32).reshape(7, 3)
    _write_all(tmp_path / "s", spec, feats)
    sh = st.open_shard(tmp_path / "s", spec.backbone, "c0", "train", "r")
    assert sh.path == "bb_x_1/c0/train"
    a = dict(sh.attrs)
    assert a["complete"] is True and a["n"] == 7 and a["dim"] == 3 and a["cache_key"] == spec.key
    assert len(a["chunk_sha256"]) == 3 and sh["features"].chunks == (3, 3)
    out = load_split(tmp_path / "s", ["bb/x:1"], "train")["c0"]
    np.testing.assert_array_equal(out.features, feats)
    assert out.labels.dtype == np.int64 and list(out.sample_ids) == list(spec.sample_ids)
    assert verify_store(tmp_path / "s") == []


def test_not_complete_until_every_chunk_written(tmp_path):
    spec = _spec()
    st.init_store(tmp_path, ["a", "b"], "m")
    assert st.prepare_shard(tmp_path, spec) is False
    sh = st.open_shard(tmp_path, spec.backbone, "c0", "train")
    st.write_chunk(sh, 0, np.ones((3, 3), np.float32))
    assert st.missing_chunks(sh) == [1, 2]
    with pytest.raises(UserError, match="chunk 1"):
        st.finalize_shard(tmp_path, spec)
    assert not sh.attrs.get("complete") and not open_store(tmp_path).shards[0].complete
    with pytest.raises(UserError, match="incomplete"):
        load_split(tmp_path, ["bb/x:1"], "train")
    # A second prepare with the same key resumes: chunk 0 is kept.
    assert st.prepare_shard(tmp_path, spec) is False
    assert st.missing_chunks(st.open_shard(tmp_path, spec.backbone, "c0", "train")) == [1, 2]


def test_key_change_rebuilds_and_corruption_is_caught(tmp_path):
    spec = _spec()
    _write_all(tmp_path, spec, np.ones((7, 3), np.float32))
    assert st.prepare_shard(tmp_path, spec) is True  # cache hit
    other = _spec(weights_sha256="v" * 64)
    assert st.prepare_shard(tmp_path, other) is False  # stale shard deleted, not served
    sh = st.open_shard(tmp_path, spec.backbone, "c0", "train")
    assert sh.attrs["cache_key"] == other.key and st.missing_chunks(sh) == [0, 1, 2]
    # Overwrite data behind the store's back: verify must notice via chunk sha256.
    _write_all(tmp_path / "b", spec, np.ones((7, 3), np.float32))
    sh = st.open_shard(tmp_path / "b", spec.backbone, "c0", "train")
    sh["features"][4] = np.full(3, 2.0, np.float32)
    probs = verify_store(tmp_path / "b")
    assert probs == ["bb_x_1/c0/train: chunk 1 sha256 mismatch"]


def test_float16_is_an_option_and_overflow_is_refused(tmp_path):
    spec = _spec(dtype="float16")
    feats = np.linspace(-3, 3, 21, dtype=np.float32).reshape(7, 3)
    _write_all(tmp_path, spec, feats)
    sh = st.open_shard(tmp_path, spec.backbone, "c0", "train", "r")
    assert sh["features"].dtype == np.float16 and sh.attrs["dtype"] == "float16"
    out = load_split(tmp_path, ["bb/x:1"], "train")["c0"].features
    assert out.dtype == np.float32 and np.abs(out - feats).max() < 3e-3
    with pytest.raises(UserError, match="NaN/inf"):
        _write_all(tmp_path / "o", _spec(dtype="float16"), np.full((7, 3), 7e4, np.float32))


def test_import_verify_inspect_export_cli(tmp_path):
    rng = np.random.default_rng(0)
    feats, labels = rng.normal(size=(5, 4)).astype(np.float32), np.array([0, 1, 2, 1, 0])
    np.savez(tmp_path / "f.npz", features=feats, labels=labels, sample_ids=np.array([f"s{i}" for i in range(5)]))
    with h5py.File(tmp_path / "g.h5", "w") as f:
        f["features"], f["labels"] = feats[:3] * 2, labels[:3]
    store = str(tmp_path / "store")
    r = CliRunner()
    res = r.invoke(main, ["import", "--store", store, "--backbone", "ext:clip", "--client", "c0", "--split", "train",
                          "--classes", "x,y,z", str(tmp_path / "f.npz")])
    assert res.exit_code == 0, res.output
    res = r.invoke(main, ["import", "--store", store, "--backbone", "ext:clip", "--client", "c0", "--split", "test",
                          "--domain", "dd", str(tmp_path / "g.h5")])
    assert res.exit_code == 0, res.output
    sh = st.open_shard(store, "ext:clip", "c0", "train", "r")
    import hashlib
    assert sh.attrs["weights_sha256"] == hashlib.sha256((tmp_path / "f.npz").read_bytes()).hexdigest()
    np.testing.assert_array_equal(load_split(store, "ext:clip", "train")["c0"].features, feats)
    assert load_split(store, "ext:clip", "test")["c0"].domain == "dd"
    assert r.invoke(main, ["verify", store]).exit_code == 0
    rep = json.loads(r.invoke(main, ["inspect", store, "--json"]).output)
    assert [(s["shard"], s["n"], s["dim"], s["complete"]) for s in rep["shards"]] == [
        ("ext_clip/c0/test", 3, 4, True), ("ext_clip/c0/train", 5, 4, True)]
    assert all(s["bytes"] > 0 for s in rep["shards"])
    out = tmp_path / "e.h5"
    assert r.invoke(main, ["export", "--store", store, "--format", "h5", "--out", str(out)]).exit_code == 0
    with h5py.File(out) as f:
        np.testing.assert_array_equal(f["ext_clip/c0/train/features"][()], feats)
        assert [x.decode() for x in f["ext_clip/c0/train/sample_ids"][()]] == [f"s{i}" for i in range(5)]
        assert json.loads(f.attrs["classes"]) == ["x", "y", "z"]
    # Wrong D for an existing backbone, label out of range, bad file: one line, exit 2.
    np.savez(tmp_path / "bad.npz", features=np.zeros((2, 5)), labels=np.array([0, 1]))
    np.savez(tmp_path / "lab.npz", features=np.zeros((2, 4)), labels=np.array([0, 9]))
    (tmp_path / "junk.h5").write_text("not hdf5")
    for f, msg in (("bad.npz", "feature dim 5 differs"), ("lab.npz", "outside the class list"),
                   ("junk.h5", "junk.h5: cannot read"), ("nope.npz", "nope.npz: file not found")):
        res = r.invoke(main, ["import", "--store", store, "--backbone", "ext:clip", "--client", "c1", "--split", "train",
                              str(tmp_path / f)])
        assert res.exit_code == 2 and msg in res.output and res.output.count("\n") == 1, res.output
    assert r.invoke(main, ["verify", store]).exit_code == 0


def test_import_mat_transposed(tmp_path):
    from scipy.io import savemat

    savemat(tmp_path / "d.mat", {"X": np.arange(12.0).reshape(3, 4), "Y": np.array([[0, 1, 1, 0]])})
    res = CliRunner().invoke(main, ["import", "--store", str(tmp_path / "s"), "--backbone", "raw", "--client", "mn",
                                    "--split", "train", "--features-key", "X", "--labels-key", "Y", "--transpose",
                                    str(tmp_path / "d.mat")])
    assert res.exit_code == 0, res.output
    out = load_split(tmp_path / "s", "raw", "train")["mn"]
    np.testing.assert_array_equal(out.features, np.arange(12.0).reshape(3, 4).T)
    assert list(out.labels) == [0, 1, 1, 0]


def test_verify_fails_on_incomplete(tmp_path):
    st.init_store(tmp_path, ["a", "b"], "m")
    st.prepare_shard(tmp_path, _spec())
    res = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert res.exit_code == 1 and "bb_x_1/c0/train: attributes missing: chunk_sha256, complete" in res.output
    res = CliRunner().invoke(main, ["export", "--store", str(tmp_path), "--out", str(tmp_path / "x.h5")])
    assert res.exit_code == 2 and "incomplete" in res.output and not (tmp_path / "x.h5").exists()


def test_store_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty and is not an embedcache store"):
        st.init_store(tmp_path, ["a"], "m")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(UserError, match="classes"):
        st.init_store(tmp_path / "s", ["a"], "m")
        st.init_store(tmp_path / "s", ["b"], "m")
