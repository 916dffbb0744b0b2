"""The synthetic iNaturalist-Users-120K store of the scale benchmark (benchmarks/inat_store.py):
its fast writer leaves exactly the shard `embedcache.store.write_shard` writes, the store is
checked clean and read by `fedheads`, its sizes are the shape's and it is the same from the same seed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from embedcache.federation_shapes import draw_sizes, load_shape
from embedcache.store import writer as S
from embedcache.store.maintenance import verify_store
from embedcache.store.reader import load_split, open_store

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import inat_store as I  # noqa: E402

CFG = I.InatConfig(seed=3, clients=40, classes=9, dim=12, test_rows=300)
SMALL = I.InatConfig(seed=3, clients=8, classes=5, dim=4, test_rows=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return I.build(CFG, tmp_path_factory.mktemp("cache"), workers=1)


def _tree(shard: Path) -> dict[str, object]:
    """Every zarr.json under a shard (parsed) and every chunk file's bytes."""
    return {str(p.relative_to(shard)): json.loads(p.read_text()) if p.name == "zarr.json" else p.read_bytes()
            for p in sorted(shard.rglob("*")) if p.is_file()}


def test_fast_writer_leaves_the_shard_write_shard_writes(built, tmp_path):
    path, _ = built
    info = open_store(path)
    other = tmp_path / "ref.zarr"
    S.init_store(other, info.classes, "ref", clients=list(info.clients))
    big = max(info.clients, key=lambda c: info.shard(I.BACKBONE, c, "train").n)
    for client in (big, info.clients[-1]):
        for split in ("train", "test"):
            rows = load_split(path, [I.BACKBONE], split, clients=[client])[client]
            spec = I.spec_for(client, split, rows.labels, CFG.dim, f"inat-synthetic-{CFG.key()}")
            S.write_shard(other, spec, rows.features)
            mine = _tree(path / I.BACKBONE / client / split)
            ref = _tree(other / I.BACKBONE / client / split)
            assert mine.keys() == ref.keys() and mine == ref, (client, split)
    assert info.shard(I.BACKBONE, big, "train").n > 1


def test_store_is_clean_and_has_the_shapes_sizes(built):
    path, facts = built
    assert verify_store(path) == []
    info = open_store(path)
    n_tr = np.array([info.shard(I.BACKBONE, c, "train").n for c in info.clients])
    n_te = np.array([info.shard(I.BACKBONE, c, "test").n for c in info.clients])
    want = draw_sizes(load_shape(CFG.shape), CFG.clients)
    assert sorted(n_tr.tolist()) == sorted(want.tolist()) and not np.array_equal(n_tr, want)  # seeded order
    assert n_te.min() >= 1 and n_te.sum() == max(CFG.clients, round(CFG.test_rows * CFG.clients / 9275))
    assert facts["train_rows"] == n_tr.sum() and facts["feature_bytes"] == 4 * CFG.dim * (n_tr.sum() + n_te.sum())


def test_test_sizes_keep_the_total_and_one_row_each():
    t = I.test_sizes(np.array([10, 1, 1, 100]), 30)
    assert t.sum() == 30 and t.min() >= 1 and t[3] > t[0] > t[1]
    assert I.test_sizes(np.array([5, 5]), 1).tolist() == [1, 1]  # at least one each, even past the total


def test_same_seed_same_store_and_fedheads_reads_it(built, tmp_path):
    from fedheads.run.load import load_fed_data

    one, _ = I.build(SMALL, tmp_path / "a", workers=1)
    again, _ = I.build(SMALL, tmp_path / "b", workers=1)
    assert _tree(again / I.BACKBONE) == _tree(one / I.BACKBONE)
    other, _ = I.build(I.InatConfig(**{**SMALL.__dict__, "seed": 4}), tmp_path / "a", workers=1)
    assert _tree(other / I.BACKBONE) != _tree(one / I.BACKBONE)
    path, _ = built
    data = load_fed_data(str(path), [I.BACKBONE], device="cpu", layout="auto")
    assert data.num_clients == CFG.clients and sum(data.n_train) == int(draw_sizes(load_shape(CFG.shape), 40).sum())


def test_worker_processes_write_the_same_store(built, tmp_path, monkeypatch):
    path, _ = built
    monkeypatch.setattr(I, "PART", 15)  # 40 clients: three tasks over two processes
    two, facts = I.build(CFG, tmp_path, workers=2)
    assert facts["build_workers"] == 2
    assert _tree(two / I.BACKBONE) == _tree(path / I.BACKBONE)  # every shard's metadata and chunk bytes


def test_unfinished_build_is_rebuilt(tmp_path):
    path, facts = I.build(SMALL, tmp_path, workers=1)
    (path.parent / I.DONE).unlink()
    (path / "stray").write_text("x")  # a build killed half way
    path2, facts2 = I.build(SMALL, tmp_path, workers=1)
    assert path2 == path and not (path / "stray").exists() and facts2["train_rows"] == facts["train_rows"]


def test_labels_are_long_tailed_and_client_skewed(tmp_path):
    cfg = I.InatConfig(seed=0, clients=400, classes=50, dim=4)
    fed = I.federation(cfg, np.random.default_rng(0))
    y = np.concatenate(fed.y_train)
    counts = np.sort(np.bincount(y, minlength=50))[::-1]
    assert counts[0] > 5 * np.median(counts)  # long tail
    p = np.bincount(y, minlength=50) / len(y)
    rng = np.random.default_rng(1)

    def tv(labels: np.ndarray) -> float:  # total variation distance of a client's labels from the pooled ones
        return 0.5 * np.abs(np.bincount(labels, minlength=50) / len(labels) - p).sum()

    big = [k for k in range(400) if fed.n_train[k] >= 20]
    skewed = np.median([tv(fed.y_train[k]) for k in big])
    iid = np.median([tv(rng.choice(50, size=fed.n_train[k], p=p)) for k in big])  # the same sizes, no skew
    assert len(big) > 20 and skewed > 2 * iid, (skewed, iid)
