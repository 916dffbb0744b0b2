"""Extraction with test doubles: cache hits, rebuilds, views, bad input, kill -9 resume, dask."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import store_doubles as d
import torch

from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.store import writer as st
from embedcache.store.maintenance import verify_store
from embedcache.store.reader import load_split, open_store

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return d.make_imagefolder(tmp_path_factory.mktemp("imgs"))


def _cfg(store: Path, **kw) -> ExtractConfig:
    base = dict(backbones=("tiny",), store=str(store), chunk_rows=3, batch_size=2, num_workers=2, progress=False)
    base.update(kw)
    return ExtractConfig(**base)


def _run(images: Path, store: Path, source=None, manifest=None, **kw):
    return extract(manifest or d.make_manifest(images), _cfg(store, **kw), source=source or d.FolderSource(str(images)),
                   backbone_factory=d.tiny_factory)


def assert_stores_equal(a: Path, b: Path) -> None:
    """Bitwise: every array's bytes and every shard's attributes."""
    ia, ib = open_store(a), open_store(b)
    assert [s.path for s in ia.shards] == [s.path for s in ib.shards] and ia.shards
    for s in ia.shards:
        ga = st.open_shard(a, s.backbone, s.client, s.split, "r")
        gb = st.open_shard(b, s.backbone, s.client, s.split, "r")
        assert dict(ga.attrs) == dict(gb.attrs), s.path
        for name in ("features", "labels", "views", "done"):
            if name in ga:
                assert ga[name][...].tobytes() == gb[name][...].tobytes(), f"{s.path}/{name}"
        assert np.asarray(ga["sample_ids"][...]).tolist() == np.asarray(gb["sample_ids"][...]).tolist()


def test_extract_matches_backbone_and_rerun_is_a_cache_hit(images, tmp_path):
    m = d.make_manifest(images)
    rep = _run(images, tmp_path / "s", backbones=("tiny", "tiny2"))
    assert (rep.shards, rep.cache_hits, rep.rows_computed) == (8, 0, 60)
    out = load_split(tmp_path / "s", ["tiny", "tiny2"], "train")
    bb, bb2, src = d.tiny_factory("tiny", None, "cpu"), d.tiny_factory("tiny2", None, "cpu"), d.FolderSource(str(images))
    for c in m.clients:
        x = torch.stack([bb.transform(src.load(s.locator)) for s in c.train])
        want = np.concatenate([bb.embed(x).numpy(), bb2.embed(x).numpy()], axis=1)
        np.testing.assert_allclose(out[c.name].features, want, rtol=1e-5, atol=1e-6)
        assert list(out[c.name].sample_ids) == [s.id for s in c.train]
        assert list(out[c.name].labels) == [s.label for s in c.train]
    assert verify_store(tmp_path / "s") == []
    # Same settings again: attributes only, the source must not be touched.
    rep = _run(images, tmp_path / "s", source=d.FolderSource(str(images), fail=True), backbones=("tiny", "tiny2"))
    assert (rep.cache_hits, rep.rows_computed, rep.changed) == (8, 0, False)


def test_changed_settings_rebuild_the_shard(images, tmp_path):
    _run(images, tmp_path / "s")
    rep = _run(images, tmp_path / "s", dtype="float16")  # dtype is part of the cache key
    assert rep.cache_hits == 0 and rep.rows_computed == 30
    assert {s.dtype for s in open_store(tmp_path / "s").shards} == {"float16"}
    m = d.make_manifest(images)
    c0 = m.clients[0]
    fewer = replace(m, clients=(replace(c0, train=c0.train[:-1]),) + m.clients[1:])  # sample list changed
    rep = _run(images, tmp_path / "s", dtype="float16", manifest=fewer)
    assert rep.cache_hits == 3 and rep.rows_computed == len(c0.train) - 1
    assert load_split(tmp_path / "s", "tiny", "train")["c-a"].features.shape == (len(c0.train) - 1, 4)


def test_views_are_seeded_per_sample_and_features_stay_clean(images, tmp_path):
    _run(images, tmp_path / "plain", batch_size=4)  # same batches: same float results
    _run(images, tmp_path / "v", views=3, batch_size=4, num_workers=3)
    _run(images, tmp_path / "v2", views=3, batch_size=4, num_workers=1)
    a = load_split(tmp_path / "plain", "tiny", "train")
    b = load_split(tmp_path / "v", "tiny", "train", views=True)
    for c in a:
        assert a[c].features.tobytes() == b[c].features.tobytes()
        assert b[c].views.shape == (3, *a[c].features.shape)
        assert not np.array_equal(b[c].views[0], b[c].views[1])
    assert_stores_equal(tmp_path / "v", tmp_path / "v2")  # thread count does not change the views


def _broken_manifest(images: Path, tmp_path: Path, what: str):
    m = d.make_manifest(images)
    c0 = m.clients[0]
    s0 = c0.train[4]
    if what == "corrupt":
        root = tmp_path / "copy"
        d.make_imagefolder(root)
        (root / s0.locator).write_bytes(b"\x89PNG\r\n\x1a\nthis is not an image")
        return m, d.FolderSource(str(root)), s0.locator
    if what == "missing":
        bad = replace(s0, locator="a/cat/none.png")
    else:
        bad = replace(s0, label=7)
    train = c0.train[:4] + (bad,) + c0.train[5:]
    return replace(m, clients=(replace(c0, train=train),) + m.clients[1:]), d.FolderSource(str(images)), \
        bad.locator if what == "missing" else bad.id


@pytest.mark.parametrize("what", ["corrupt", "missing", "label"])
def test_bad_input_is_one_line_and_nothing_complete(images, tmp_path, what):
    m, src, item = _broken_manifest(images, tmp_path, what)
    with pytest.raises(UserError) as exc:
        _run(images, tmp_path / "s", manifest=m, source=src)
    msg = str(exc.value)
    assert item in msg and "\n" not in msg
    if what == "label":  # caught while planning, before any shard: the new store is removed
        assert not (tmp_path / "s").exists()
        return
    info = open_store(tmp_path / "s")
    assert not any(s.complete for s in info.shards if s.client == "c-a" and s.split == "train")
    assert verify_store(tmp_path / "s") != []


def test_unknown_backbone_and_bad_settings(images, tmp_path):
    with pytest.raises(UserError, match="nope: unknown backbone"):
        _run(images, tmp_path / "s", backbones=("nope",))
    with pytest.raises(UserError, match="dtype float64"):
        _run(images, tmp_path / "s", dtype="float64")
    with pytest.raises(UserError, match="float16 overflow"):
        _run(images, tmp_path / "s", backbones=("tiny-huge",), dtype="float16")


_KILL_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {repo!r}]
from pathlib import Path
import store_doubles as d
from embedcache.extraction import ExtractConfig, extract
cfg = ExtractConfig(backbones=("tiny-slow",), store={store!r}, chunk_rows=2, batch_size=1, progress=False)
extract(d.make_manifest(Path({images!r})), cfg, source=d.FolderSource({images!r}), backbone_factory=d.tiny_factory)
"""


def test_kill_minus_9_then_resume_is_bitwise_identical(images, tmp_path, monkeypatch):
    store = tmp_path / "killed"
    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT.format(tests=str(TESTS), repo=str(TESTS.parent), store=str(store), images=str(images)))
    env = dict(os.environ, TINY_DELAY="0.1")
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    done_dir = store / "tiny-slow" / "c-a" / "train" / "done" / "c"
    deadline = time.monotonic() + 300  # imports and a first chunk on a loaded 2-core machine
    while time.monotonic() < deadline and proc.poll() is None:
        if done_dir.is_dir() and sum(1 for _ in done_dir.iterdir()) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "extract finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not all(s.complete for s in open_store(store).shards)
    monkeypatch.setenv("TINY_DELAY", "0")
    cfg = dict(backbones=("tiny-slow",), chunk_rows=2, batch_size=1)
    rep = _run(images, store, **dict(cfg, batch_size=3))  # resumes with the batches the shards began with
    assert 0 < rep.rows_computed < 30  # only the missing chunks
    assert any("resumed with the batch size they were started with, not --batch-size 3" in n for n in rep.notes)
    _run(images, tmp_path / "fresh", **cfg)
    assert_stores_equal(store, tmp_path / "fresh")
    assert verify_store(store) == []


def test_dask_local2_is_bitwise_identical_to_single_process(images, tmp_path):
    _run(images, tmp_path / "single", views=2)
    rep = _run(images, tmp_path / "dask", views=2, scheduler="local:2")
    assert rep.rows_computed == 30
    assert_stores_equal(tmp_path / "single", tmp_path / "dask")


def test_num_workers_reaches_the_dask_workers(images, tmp_path, monkeypatch):
    import embedcache.distributed as dist

    seen = []
    monkeypatch.setattr(dist, "run_dask", lambda jobs, client, bar: seen.extend(jobs))
    monkeypatch.setattr(dist, "dask_client", lambda scheduler: __import__("contextlib").nullcontext(None))
    with pytest.raises(UserError, match="chunk 0"):  # no job ran, so finalising fails; the jobs are what count
        _run(images, tmp_path / "s", scheduler="local:2", num_workers=3)
    assert seen and {j.num_workers for j in seen} == {3}


def test_two_concurrent_extracts_on_one_store(images, tmp_path):
    """flock is per open file description, so two threads contend like two processes."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        reps = list(pool.map(lambda _: _run(images, tmp_path / "s", backbones=("tiny", "tiny2")), range(2)))
    assert all(r.shards == 8 for r in reps)
    assert verify_store(tmp_path / "s") == []
    _run(images, tmp_path / "fresh", backbones=("tiny", "tiny2"))
    assert_stores_equal(tmp_path / "s", tmp_path / "fresh")


def test_clients_a_later_manifest_dropped_are_not_served(images, tmp_path):
    """Re-partitioning into fewer clients must not leave the old clients' samples in training."""
    m = d.make_manifest(images)
    _run(images, tmp_path / "s", manifest=m)
    assert sorted(load_split(tmp_path / "s", "tiny", "train")) == ["c-a", "c-b"]
    one = replace(m, clients=m.clients[:1])
    _run(images, tmp_path / "s", manifest=one)
    assert list(load_split(tmp_path / "s", "tiny", "train")) == ["c-a"]
    assert open_store(tmp_path / "s").clients == ("c-a",)
    # still on disk, and still readable when asked for by name
    assert list(load_split(tmp_path / "s", "tiny", "train", clients=["c-b"])) == ["c-b"]


def test_cache_hit_under_a_new_manifest_updates_provenance(images, tmp_path):
    m = d.make_manifest(images)
    _run(images, tmp_path / "s", manifest=m)
    c0 = m.clients[0]
    moved = replace(m, clients=(replace(c0, domain="renamed"),) + m.clients[1:])
    rep = _run(images, tmp_path / "s", manifest=moved, source=d.FolderSource(str(images), fail=True))
    assert rep.rows_computed == 0
    assert load_split(tmp_path / "s", "tiny", "train")["c-a"].domain == "renamed"
    assert verify_store(tmp_path / "s") == []


def test_a_store_that_never_got_a_shard_is_not_left_behind(images, tmp_path):
    def unknown(name, weights_dir, device):
        raise UserError(f"{name}: unknown backbone")

    with pytest.raises(UserError, match="unknown backbone"):
        extract(d.make_manifest(images), _cfg(tmp_path / "s"), source=d.FolderSource(str(images)),
                backbone_factory=unknown)
    assert not (tmp_path / "s").exists()
