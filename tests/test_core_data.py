"""FedData: stacking/padding, bad input, sub-federations, and loading from a feature store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedcache.errors import UserError
from fedheads.run.load import from_arrays, load_fed_data, resolve_device


def _client(n: int, d: int = 3, seed: int = 0):
    rs = np.random.default_rng(seed)
    return rs.normal(size=(n, d)).astype("f4"), rs.integers(0, 2, n), rs.normal(size=(2, d)).astype("f4"), np.array([0, 1])


def test_stack_pad_mask_and_select() -> None:
    d = from_arrays([_client(3), _client(5, seed=1)], 2, client_names=["a", "b"], domains=["x", "y"])
    assert d.x_train.shape == (2, 5, 3) and d.n_train == (3, 5)
    assert d.m_train.sum(1).tolist() == [3, 5]
    assert float(d.x_train[0, 3:].abs().sum()) == 0.0
    sub = d.select([1])
    assert sub.client_names == ("b",) and sub.client_index.tolist() == [1] and sub.x_train.shape == (1, 5, 3)
    assert d.select([0]).x_train.shape == (1, 3, 3)  # padding trimmed
    assert d.class_counts().sum().item() == 8


@pytest.mark.parametrize("bad,match", [
    ([_client(3), _client(3, d=4)], "dimension differs"),
    ([_client(3), (np.zeros((0, 3), "f4"), np.zeros(0, int), np.zeros((1, 3), "f4"), np.zeros(1, int))], "no training samples"),
    ([(np.array([[np.nan, 0, 0]], "f4"), np.array([0]), np.zeros((1, 3), "f4"), np.array([0]))], "NaN"),
    ([(np.zeros((1, 3), "f4"), np.array([5]), np.zeros((1, 3), "f4"), np.array([0]))], "label out of range"),
])
def test_bad_input_raises_user_error(bad, match) -> None:
    with pytest.raises(UserError, match=match):
        from_arrays(bad, 2)


def test_device_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA"):
            resolve_device("cuda")


def test_load_from_store_concatenates_backbones(tmp_path) -> None:
    store_mod = pytest.importorskip("embedcache.store.writer")
    store = tmp_path / "s.zarr"
    store_mod.init_store(store, ["cat", "dog"], "m" * 64)
    rs = np.random.default_rng(0)
    feats = {}
    for bb, dim in (("bb1", 2), ("bb2", 3)):
        for client, n in (("c0", 4), ("c1", 3)):
            for split in ("train", "test"):
                ids = tuple(f"{client}/{split}/{i}" for i in range(n))
                labels = tuple(int(i % 2) for i in range(n))
                spec = store_mod.ShardSpec(backbone=bb, weights_sha256="w" * 64, preprocess={"size": 8}, feature_dim=dim,
                                           client=client, split=split, domain="dom-" + client, manifest_hash="m" * 64,
                                           sample_list_hash="h" + client + split, sample_ids=ids, labels=labels,
                                           views=2 if split == "train" else 1)
                x = rs.normal(size=(n, dim)).astype("f4")
                feats[bb, client, split] = x
                v = rs.normal(size=(2, n, dim)).astype("f4") if split == "train" else None
                if v is not None:
                    feats[bb, client, "views"] = v
                store_mod.write_shard(store, spec, x, views=v)
    d = load_fed_data(str(store), ["bb1", "bb2"], device="cpu")
    assert d.client_names == ("c0", "c1") and d.domains == ("dom-c0", "dom-c1") and d.num_classes == 2
    want = np.concatenate([feats["bb1", "c1", "train"], feats["bb2", "c1", "train"]], axis=1)
    np.testing.assert_allclose(d.x_train[1, :3].numpy(), want)
    assert d.y_train[0, :4].tolist() == [0, 1, 0, 1]
    b = load_fed_data(str(store), ["bb2"], device="cpu", binarize=True)
    assert set(b.x_train.unique().tolist()) <= {-1.0, 0.0, 1.0} and b.dim == 3
    assert d.v_train is None
    v = load_fed_data(str(store), ["bb1", "bb2"], device="cpu", views=True)
    want_v = np.concatenate([feats["bb1", "c0", "views"], feats["bb2", "c0", "views"]], axis=2)
    np.testing.assert_allclose(v.v_train[0, :, :4].numpy(), want_v)
