"""Reader API: concatenation order (FedPCL Eq. 1-2), errors, and no heavy imports."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from embedcache.errors import UserError
from embedcache.store import writer as st
from embedcache.store.reader import load_split, open_store

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _spec(backbone: str, d: int, ids=("a", "b", "c"), client="c0", **kw) -> st.ShardSpec:
    return st.ShardSpec(backbone=backbone, weights_sha256="w", preprocess={}, feature_dim=d, client=client,
                        split="train", domain="dom", manifest_hash="m", sample_list_hash=",".join(ids),
                        sample_ids=tuple(ids), labels=(0, 1, 0)[:len(ids)], chunk_rows=2, **kw)


@pytest.fixture
def store(tmp_path):
    st.init_store(tmp_path, ["x", "y"], "m")
    st.write_shard(tmp_path, _spec("b1", 2), np.array([[1, 2], [3, 4], [5, 6]], np.float32))
    st.write_shard(tmp_path, _spec("timm:b2", 1), np.array([[7], [8], [9]], np.float32))
    st.write_shard(tmp_path, _spec("b1", 2, client="c1"), np.zeros((3, 2), np.float32))
    st.consolidate(tmp_path)
    return tmp_path


def test_open_store_and_concat_in_order_asked(store):
    info = open_store(store)
    assert info.classes == ("x", "y") and info.backbones == ("b1", "timm:b2") and info.clients == ("c0", "c1")
    out = load_split(info, ["timm:b2", "b1"], "train", clients=["c0"])
    np.testing.assert_array_equal(out["c0"].features, [[7, 1, 2], [8, 3, 4], [9, 5, 6]])
    assert out["c0"].features.dtype == np.float32 and out["c0"].domain == "dom"
    assert list(load_split(store, "b1", "train")) == ["c0", "c1"]


def test_errors(store, tmp_path_factory):
    with pytest.raises(UserError, match="backbone nope: not in store"):
        load_split(store, ["b1", "nope"], "train")
    with pytest.raises(UserError, match="timm:b2/c1/train: shard missing"):
        load_split(store, ["b1", "timm:b2"], "train")
    with pytest.raises(UserError, match="no feature store"):
        open_store(tmp_path_factory.mktemp("empty"))
    # Sample ids that differ between backbones.
    st.write_shard(store, _spec("b3", 1, ids=("a", "c", "b")), np.zeros((3, 1), np.float32))
    with pytest.raises(UserError, match="c0/train: sample ids or labels differ between backbones b1 and b3"):
        load_split(store, ["b1", "b3"], "train", clients=["c0"])
    # NaN behind the writer's back.
    sh = st.open_shard(store, "b1", "c1", "train")
    sh["features"][0] = np.array([np.nan, 0], np.float32)
    with pytest.raises(UserError, match="b1/c1/train: features contain NaN/inf"):
        load_split(store, "b1", "train")
    # Incomplete shard.
    st.prepare_shard(store, _spec("b4", 1))
    with pytest.raises(UserError, match="b4/c0/train: shard incomplete"):
        load_split(store, "b4", "train")
    with pytest.raises(UserError, match="no augmented views"):
        load_split(store, "b3", "train", views=True)


def test_reader_imports_no_torch_timm_dask():
    code = ("import sys, embedcache.store.reader; bad = [m for m in ('torch', 'timm', 'dask', 'distributed', 'torchvision')"
            " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
