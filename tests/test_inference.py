"""faiss prototype inference against a numpy brute-force reference."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from embedcache.errors import UserError
from fedheads.prediction import prototypes as I


def brute_force(protos, present, rule, x, k):
    """numpy reference: full score matrix, absent classes excluded, ties -> smaller class."""
    p = protos.astype(np.float64)
    q = x.astype(np.float64)
    if rule == "cosine":
        p = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-30)
        q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-30)
        key = -(q @ p.T)
    elif rule == "ip":
        key = -(q @ p.T)
    else:
        key = (q * q).sum(1)[:, None] - 2 * q @ p.T + (p * p).sum(1)[None]
    key[:, ~present] = np.inf
    cls = np.broadcast_to(np.arange(p.shape[0]), key.shape)
    order = np.lexsort((cls, key), axis=1)[:, :k]
    return order, np.take_along_axis(key, order, 1)


@pytest.mark.parametrize("rule", I.RULES)
def test_matches_brute_force_random(rule):
    rng = np.random.default_rng(0)
    protos = rng.normal(size=(12, 16)).astype(np.float32)
    present = np.ones(12, bool)
    present[[3, 7]] = False
    x = rng.normal(size=(500, 16)).astype(np.float32)
    pred = I.predict_features(protos, present, rule, x, k=4, chunk_rows=64)
    ref_lab, ref_key = brute_force(protos, present, rule, x, 4)
    np.testing.assert_array_equal(pred.topk_labels, ref_lab)
    ref_score = -ref_key if rule in I.SIMILARITY_RULES else ref_key
    np.testing.assert_allclose(pred.topk_scores, ref_score, rtol=1e-4, atol=1e-4)
    assert not np.isin(pred.labels, [3, 7]).any()
    np.testing.assert_array_equal(pred.labels, pred.topk_labels[:, 0])


@pytest.mark.parametrize("rule", I.RULES)
def test_ties_go_to_smaller_class(rule):
    # integer data: every score is exact in float32, so ties are real ties
    base = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]], np.float32)
    protos = np.concatenate([base, base, 2 * base])      # classes 0,3,6 are one direction
    present = np.ones(9, bool)
    x = np.array([[1, 0, 0], [0, 0, 1], [1, 1, 0]], np.float32)
    pred = I.predict_features(protos, present, rule, x, k=3)
    ref_lab, _ = brute_force(protos, present, rule, x, 3)
    np.testing.assert_array_equal(pred.topk_labels, ref_lab)
    if rule == "ip":  # the unnormalised 2x copies win on inner product
        assert pred.labels[0] == 6 and pred.labels[1] == 8
    else:
        assert pred.labels[0] == 0 and pred.labels[1] == 2
    if rule == "cosine":
        assert pred.topk_labels[0].tolist() == [0, 3, 6]   # three-way tie, cut at k=3
        assert I.predict_features(protos, present, rule, x, k=2).topk_labels[0].tolist() == [0, 3]


def test_k_larger_than_present_pads():
    protos = np.eye(4, dtype=np.float32)
    present = np.array([False, True, False, True])
    pred = I.predict_features(protos, present, "sqeuclidean", np.eye(4, dtype=np.float32), k=3)
    assert pred.topk_labels[:, 2].tolist() == [-1] * 4
    assert np.isnan(pred.topk_scores[:, 2]).all()
    assert pred.labels.tolist() == [1, 1, 1, 3]


def test_chunk_iterable_and_memmap(tmp_path):
    rng = np.random.default_rng(1)
    protos = rng.normal(size=(5, 8)).astype(np.float32)
    x = rng.normal(size=(101, 8)).astype(np.float32)
    mm = np.lib.format.open_memmap(tmp_path / "f.npy", mode="w+", dtype=np.float32, shape=x.shape)
    mm[:] = x
    mm.flush()
    a = I.predict_features(protos, np.ones(5, bool), "cosine", mm, k=2, chunk_rows=10)
    b = I.predict_features(protos, np.ones(5, bool), "cosine", iter([x[:50], x[50:]]), k=2)
    np.testing.assert_array_equal(a.topk_labels, b.topk_labels)


def test_bad_input_errors():
    protos = np.zeros((3, 4), np.float32)
    with pytest.raises(UserError, match="rule='dot'"):
        I.PrototypeIndex(protos, np.ones(3, bool), "dot")
    with pytest.raises(UserError, match="no class is present"):
        I.PrototypeIndex(protos, np.zeros(3, bool), "cosine")
    with pytest.raises(UserError, match="present: 2 entries"):
        I.PrototypeIndex(protos, np.ones(2, bool), "cosine")
    idx = I.PrototypeIndex(protos, np.ones(3, bool), "sqeuclidean", use_gpu=False)
    with pytest.raises(UserError, match="dimension 5 != prototype dimension 4"):
        idx.search(np.zeros((2, 5)))
    with pytest.raises(UserError, match="NaN"):
        idx.search(np.full((1, 4), np.nan))
    assert I.as_f32(np.arange(8, dtype=np.float64).reshape(2, 4)[:, ::1], "x").flags.c_contiguous


def test_write_predictions_csv_and_parquet(tmp_path):
    protos = np.eye(3, dtype=np.float32)
    x = np.array([[1, 0, 0], [0, 0.5, 0.1]], np.float32)
    pred = I.predict_features(protos, np.ones(3, bool), "cosine", x, k=2)
    t1 = I.prediction_rows("c00", ["a/1", "a/2"], [0, 2], pred)
    t2 = I.prediction_rows("c01", ["b/1", "b/2"], [0, 1], pred)
    out = I.write_predictions([t1, t2], tmp_path / "p.csv")
    rows = list(csv.DictReader(open(out)))
    assert list(rows[0]) == ["client", "sample_id", "label", "prediction", "score",
                             "top1_label", "top1_score", "top2_label", "top2_score"]
    assert [r["client"] for r in rows] == ["c00", "c00", "c01", "c01"]
    assert rows[1]["prediction"] == "1" and float(rows[1]["score"]) == pred.scores[1]
    pq = pytest.importorskip("pyarrow.parquet")
    out2 = I.write_predictions(t1, tmp_path / "p.parquet")
    tab = pq.read_table(out2).to_pydict()
    assert tab["sample_id"] == ["a/1", "a/2"] and tab["prediction"] == [0, 1]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(UserError, match="unsupported extension"):
        I.write_predictions(t1, tmp_path / "p.txt")
    with pytest.raises(UserError, match="different columns"):
        I.write_predictions([t1, {"client": ["x"]}], tmp_path / "q.csv")
    assert not (tmp_path / "q.csv").exists()
    for ext in ("csv", "parquet"):
        with pytest.raises(UserError, match="no prediction rows"):
            I.write_predictions(iter([]), tmp_path / f"empty.{ext}")
        assert not (tmp_path / f"empty.{ext}").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.gpu
def test_gpu_index_matches_cpu():
    if not I.gpu_available():
        pytest.skip("faiss without GPU support or no GPU visible")
    rng = np.random.default_rng(2)
    protos = rng.normal(size=(10, 32)).astype(np.float32)
    x = rng.normal(size=(200, 32)).astype(np.float32)
    for rule in I.RULES:
        a = I.predict_features(protos, np.ones(10, bool), rule, x, k=3, use_gpu=True)
        b = I.predict_features(protos, np.ones(10, bool), rule, x, k=3, use_gpu=False)
        np.testing.assert_array_equal(a.topk_labels, b.topk_labels)


def test_streams_a_zarr_array_in_row_chunks(tmp_path):
    zarr = pytest.importorskip("zarr")
    rng = np.random.default_rng(3)
    protos = rng.normal(size=(6, 8)).astype(np.float32)
    x = rng.normal(size=(75, 8)).astype(np.float32)
    z = zarr.create_array(str(tmp_path / "f.zarr"), shape=x.shape, chunks=(16, 8), dtype="float32")
    z[:] = x
    seen = []
    chunks = I.iter_row_chunks(z, chunk_rows=16)
    got = I.predict_features(protos, np.ones(6, bool), "sqeuclidean",
                             (seen.append(c.shape[0]) or c for c in chunks), k=2)
    assert seen == [16, 16, 16, 16, 11]
    ref, _ = brute_force(protos, np.ones(6, bool), "sqeuclidean", x, 2)
    np.testing.assert_array_equal(got.topk_labels, ref)
