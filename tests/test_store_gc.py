"""A store that switches manifests says so (current vs stale shards), `gc` and `rm` remove
shards, and a failed import leaves the store exactly as it was (contract 4)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import store_doubles as d
from click.testing import CliRunner

from embedcache.cli import main as ec
from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.store import importer as store_import
from embedcache.store import writer as st
from embedcache.store.importer import import_features
from embedcache.store.layout import DROPPED, OLDER
from embedcache.store.maintenance import verify_store
from embedcache.store.reader import load_split, open_store


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return d.make_imagefolder(tmp_path_factory.mktemp("imgs"))


def _extract(images: Path, store: Path, manifest, backbones=("tiny",)):
    cfg = ExtractConfig(backbones=backbones, store=str(store), chunk_rows=3, batch_size=2, num_workers=1, progress=False)
    return extract(manifest, cfg, source=d.FolderSource(str(images)), backbone_factory=d.tiny_factory)


def _inspect(store: Path) -> dict[str, str | None]:
    res = CliRunner().invoke(ec, ["inspect", "--json", str(store)])
    assert res.exit_code == 0, res.output
    return {s["shard"]: s["stale"] for s in json.loads(res.stdout)["shards"]}


def _files(store: Path) -> dict[str, bytes]:
    """Every file under the store with its bytes: 'exactly as before' means equal."""
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


@pytest.fixture
def switched(images, tmp_path) -> tuple[Path, dict]:
    """Manifest m (clients c-a, c-b) with backbones tiny and tiny2, then manifest m2 (c-a only,
    one train sample fewer) with tiny alone."""
    m = d.make_manifest(images)
    store = tmp_path / "s"
    _extract(images, store, m, backbones=("tiny", "tiny2"))
    c0 = m.clients[0]
    m2 = replace(m, clients=(replace(c0, train=c0.train[:-1]),))
    _extract(images, store, m2)
    return store, {"m": m, "m2": m2}


def test_a_second_manifest_leaves_stale_shards_that_inspect_marks_and_gc_removes(switched):
    store, _ = switched
    stale = {"tiny/c-b/test": DROPPED, "tiny/c-b/train": DROPPED, "tiny2/c-a/test": OLDER,
             "tiny2/c-a/train": OLDER, "tiny2/c-b/test": DROPPED, "tiny2/c-b/train": DROPPED}
    assert _inspect(store) == {"tiny/c-a/test": None, "tiny/c-a/train": None, **stale}
    table = CliRunner().invoke(ec, ["inspect", str(store)]).output
    assert "6 stale (`embedcache gc` removes them)" in table and f"stale: {OLDER}" in table
    # the current client is served from tiny; its tiny2 shards come from the older manifest
    assert list(load_split(store, "tiny", "train")) == ["c-a"]
    with pytest.raises(UserError, match=f"tiny2/c-a/train: stale, {OLDER}.*extract"):
        load_split(store, "tiny2", "train")
    res = CliRunner().invoke(ec, ["gc", "--dry-run", str(store)])
    assert res.exit_code == 0 and sorted(ln.split()[3] for ln in res.output.splitlines()) == sorted(stale)
    assert len(_inspect(store)) == 8
    res = CliRunner().invoke(ec, ["gc", str(store)])
    assert res.exit_code == 0 and sorted(ln.split()[2] for ln in res.output.splitlines()) == sorted(stale), res.output
    assert _inspect(store) == {"tiny/c-a/test": None, "tiny/c-a/train": None}
    assert sorted(p.name for p in store.iterdir() if p.is_dir()) == ["tiny"]  # empty groups gone too
    assert verify_store(store) == [] and st.has_consolidated(store)
    assert CliRunner().invoke(ec, ["gc", str(store)]).output.startswith("gc: nothing stale")


def test_re_extracting_under_the_current_manifest_makes_a_stale_shard_current(images, switched):
    store, ms = switched
    rep = _extract(images, store, ms["m2"], backbones=("tiny2",))
    assert rep.cache_hits == 1  # c-a/test did not change; c-a/train lost a sample
    assert _inspect(store)["tiny2/c-a/train"] is None
    n = len(ms["m2"].clients[0].train)
    assert load_split(store, ["tiny", "tiny2"], "train")["c-a"].features.shape == (n, 8)


def test_imports_join_the_current_manifest_and_survive_a_re_extraction_of_it(images, tmp_path):
    m = d.make_manifest(images)
    store = tmp_path / "s"
    _extract(images, store, m)
    np.savez(tmp_path / "f.npz", features=np.ones((4, 4), np.float32), labels=np.array([0, 1, 2, 0]))
    # under a name of its own: features imported under the extracted backbone's name are refused
    import_features(store, tmp_path / "f.npz", backbone="ext", client="extra", split="train")
    assert _inspect(store)["ext/extra/train"] is None
    _extract(images, store, m)  # same manifest again: the imported client stays listed
    assert "extra" in open_store(store).clients and _inspect(store)["ext/extra/train"] is None
    _extract(images, store, replace(m, clients=m.clients[:1]))
    assert _inspect(store)["ext/extra/train"] == DROPPED


def test_rm_removes_exactly_what_was_asked_and_refuses_nonsense(switched):
    store, _ = switched
    before = _inspect(store)
    res = CliRunner().invoke(ec, ["rm", str(store), "--backbone", "tiny", "--client", "c-a", "--split", "test",
                                  "--dry-run"])
    assert res.exit_code == 0 and res.output == "rm: would remove tiny/c-a/test\n" and _inspect(store) == before
    res = CliRunner().invoke(ec, ["rm", str(store), "--backbone", "tiny", "--client", "c-a", "--split", "test"])
    assert res.exit_code == 0 and res.output == "rm: removed tiny/c-a/test\n"
    assert set(before) - set(_inspect(store)) == {"tiny/c-a/test"} and verify_store(store) == []
    with pytest.raises(UserError, match="tiny/c-a/test: shard missing"):  # never silently dropped
        load_split(store, "tiny", "test")
    res = CliRunner().invoke(ec, ["rm", str(store), "--backbone", "tiny2"])
    assert res.exit_code == 0 and res.output.count("removed tiny2/") == 4 and not (store / "tiny2").exists()
    for args, msg in ((["--backbone", "nope"], "backbone nope: not in store"),
                      (["--backbone", "tiny", "--client", "zz"], "client zz: has no shard of backbone tiny"),
                      (["--backbone", "tiny", "--client", "c-a", "--split", "test"], "tiny/c-a/test: no such shard")):
        res = CliRunner().invoke(ec, ["rm", str(store), *args])
        assert res.exit_code == 2 and res.output.count("\n") == 1 and msg in res.output, res.output
    assert open_store(store).clients == ("c-a",)  # the client list never changes


# -- a failed import leaves the store as it was ---------------------------------------------------

def _import_store(tmp_path: Path) -> Path:
    store = tmp_path / "s"
    rng = np.random.default_rng(0)
    for c in ("c0", "c1"):
        np.savez(tmp_path / f"{c}.npz", features=rng.normal(size=(7, 3)).astype(np.float32), labels=np.arange(7) % 3)
        import_features(store, tmp_path / f"{c}.npz", backbone="bb", client=c, split="train", classes=["x", "y", "z"],
                        chunk_rows=3)
    return store


def test_refused_imports_touch_nothing(tmp_path):
    store = _import_store(tmp_path)
    before = _files(store)
    np.savez(tmp_path / "lab.npz", features=np.zeros((2, 3)), labels=np.array([0, 7]))
    np.savez(tmp_path / "dim.npz", features=np.zeros((2, 5)), labels=np.array([0, 1]))
    np.savez(tmp_path / "big.npz", features=np.full((2, 3), 1e6), labels=np.array([0, 1]))
    cases = [(dict(file="lab.npz", client="new"), "outside the class list"),
             (dict(file="dim.npz", client="new"), "feature dim 5 differs"),
             (dict(file="c0.npz", client="new", dtype="float64"), "dtype float64"),
             (dict(file="big.npz", client="new", dtype="float16"), "NaN/inf (as float16)"),
             (dict(file="c0.npz", client="C0"), "collides with existing client c0"),
             (dict(file="c0.npz", client="new", backbone="BB"), "collides with existing group bb")]
    for kw, msg in cases:
        kw = {"backbone": "bb", "split": "train", **kw}
        with pytest.raises(UserError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            import_features(store, tmp_path / kw.pop("file"), **kw)
        assert _files(store) == before, msg


@pytest.mark.parametrize("what", ["new client", "replaced shard", "new store", "new backbone"])
def test_an_import_that_fails_while_writing_is_rolled_back(tmp_path, monkeypatch, what):
    store = _import_store(tmp_path)
    before = _files(store)
    np.savez(tmp_path / "other.npz", features=np.full((5, 3), 2.0, np.float32), labels=np.arange(5) % 3)
    target = {"new client": (store, "bb", "c9"), "replaced shard": (store, "bb", "c1"),
              "new store": (tmp_path / "fresh", "bb", "c0"), "new backbone": (store, "bb2", "c0")}[what]

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(store_import.st, "finalize_shard", disk_full)
    with pytest.raises(UserError, match="No space left on device.*free space"):
        import_features(target[0], tmp_path / "other.npz", backbone=target[1], client=target[2], split="train")
    assert _files(store) == before
    assert not (tmp_path / "fresh").exists()
    monkeypatch.undo()
    assert verify_store(store) == [] and open_store(store).clients == ("c0", "c1")
    # the same import, not interrupted, then works (and replaces c1's shard when asked to)
    import_features(target[0], tmp_path / "other.npz", backbone=target[1], client=target[2], split="train")
    assert load_split(target[0], target[1], "train", clients=[target[2]])[target[2]].features[0, 0] == 2.0
    assert not list(target[0].rglob(".import-backup-*"))


def test_gc_sweeps_the_shard_a_killed_import_had_set_aside(tmp_path):
    store = _import_store(tmp_path)
    leftover = store / "bb" / "c0" / ".import-backup-999999999"
    (leftover / "train").mkdir(parents=True)
    (leftover / "train" / "zarr.json").write_text("{}")
    assert verify_store(store) == []  # invisible to zarr
    res = CliRunner().invoke(ec, ["gc", str(store)])
    assert res.exit_code == 0 and "removed bb/c0/.import-backup-999999999" in res.output and not leftover.exists()
