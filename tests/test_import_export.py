"""`embedcache import` reads what `embedcache export` writes, for every export format (features
bit-identical in their stored dtype, ids, labels, domains, classes and views kept), and imports
many clients in one call (an HDF5 file with a group per client, a directory of per-client files),
all or nothing (docs/contracts.md, section 4a)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import store_doubles as d
from click.testing import CliRunner

from embedcache.cli import main as ec
from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.store import importer as store_import
from embedcache.store.export import EXPORT_FORMATS, export_store
from embedcache.store.importer import import_many
from embedcache.store.layout import open_group
from embedcache.store.maintenance import verify_store
from embedcache.store.reader import load_split, open_store
from tests.store_doubles import assert_one_line


@pytest.fixture(scope="module")
def extracted(tmp_path_factory) -> Path:
    """Two clients, backbone tiny in float32 with 2 views, tiny2 in float16: every stored form."""
    root = tmp_path_factory.mktemp("ie")
    images = d.make_imagefolder(root / "imgs")
    m = d.make_manifest(images)
    store = root / "s"
    for bb, kw in (("tiny", {"views": 2}), ("tiny2", {"dtype": "float16"})):
        cfg = ExtractConfig(backbones=(bb,), store=str(store), chunk_rows=3, batch_size=2, num_workers=1,
                            progress=False, **kw)
        extract(m, cfg, source=d.FolderSource(str(images)), backbone_factory=d.tiny_factory)
    return store


def _stored(store: Path) -> dict[str, tuple]:
    """Per shard: the raw stored arrays (dtype included) and the domain."""
    info = open_store(store)
    root = open_group(info.path, False)
    out = {}
    for s in info.shards:
        g = root[s.path]
        views = g["views"][...] if "views" in g else None
        out[s.path] = (g["features"][...], g["labels"][...], [str(x) for x in np.asarray(g["sample_ids"][...]).tolist()], views,
                       g.attrs["domain"], g.attrs["backbone"])
    return out


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_import_reads_every_export_format_bit_for_bit(extracted, tmp_path, fmt):
    out = tmp_path / ("e.h5" if fmt == "h5" else "e")
    res = CliRunner().invoke(ec, ["export", "--store", str(extracted), "--format", fmt, "--out", str(out)])
    assert res.exit_code == 0, res.output
    new = tmp_path / "imported"
    res = CliRunner().invoke(ec, ["import", "--store", str(new), str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.count("import: ") == 8  # 2 backbones x 2 clients x 2 splits, one line each
    before, after = _stored(extracted), _stored(new)
    assert sorted(before) == sorted(after)
    for path, (f0, y0, i0, v0, dom0, bb0) in before.items():
        f1, y1, i1, v1, dom1, bb1 = after[path]
        assert f1.dtype == f0.dtype and f1.tobytes() == f0.tobytes(), path  # bit-identical, float16 kept
        assert (v0 is None) == (v1 is None) and (v0 is None or v1.tobytes() == v0.tobytes()), path
        np.testing.assert_array_equal(y1, y0)
        assert i1 == i0 and (dom1, bb1) == (dom0, bb0), path
    assert open_store(new).classes == open_store(extracted).classes
    assert set(open_store(new).clients) == set(open_store(extracted).clients)
    assert verify_store(new) == []
    # the imported shards serve like extracted ones, views included
    a = load_split(extracted, ["tiny"], "train", views=True)
    b = load_split(new, ["tiny"], "train", views=True)
    for c in a:
        assert a[c].views.tobytes() == b[c].views.tobytes()
    # --backbone picks one backbone of an export
    only = tmp_path / "only"
    import_many(only, out, backbone="tiny2")
    assert open_store(only).backbones == ("tiny2",)


def test_export_npz_replaces_its_own_directory_only(extracted, tmp_path):
    out = tmp_path / "e"
    export_store(extracted, out, "npz")
    export_store(extracted, out, "npz")  # a re-export replaces it
    assert (out / "export.json").is_file() and not list(tmp_path.glob(".e.*"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="not an npz export"):
        export_store(extracted, tmp_path / "mine", "npz")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def _client_arrays(seed: int, n: int, d: int = 4, c: int = 3):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), np.arange(n) % c


def test_many_clients_from_one_hdf5_with_a_group_per_client(tmp_path):
    f = tmp_path / "clients.h5"
    data = {(c, s): _client_arrays(i * 2 + j, 5 + i) for i, c in enumerate(("hosp-a", "hosp-b", "hosp-c"))
            for j, s in enumerate(("train", "test"))}
    with h5py.File(f, "w") as h:
        for (c, s), (x, y) in data.items():
            h[f"{c}/{s}/features"], h[f"{c}/{s}/labels"] = x, y
    res = CliRunner().invoke(ec, ["import", "--store", str(tmp_path / "s"), "--backbone", "ext", "--classes", "a,b,c",
                                  str(f)])
    assert res.exit_code == 0, res.output
    info = open_store(tmp_path / "s")
    assert info.clients == ("hosp-a", "hosp-b", "hosp-c") and info.classes == ("a", "b", "c")
    for s in ("train", "test"):
        got = load_split(tmp_path / "s", "ext", s)
        for c in info.clients:
            np.testing.assert_array_equal(got[c].features, data[(c, s)][0])
            np.testing.assert_array_equal(got[c].labels, data[(c, s)][1])
            assert got[c].domain == c


@pytest.mark.parametrize("layout", ["<client>_<split>.npz", "<client>/<split>.npz"])
def test_many_clients_from_a_directory_of_per_client_files(tmp_path, layout):
    src = tmp_path / "feats"
    data = {}
    for i, c in enumerate(("c0", "c-1")):
        for j, s in enumerate(("train", "test")):
            x, y = data[(c, s)] = _client_arrays(10 * i + j, 4 + j)
            f = src / (f"{c}_{s}.npz" if layout.startswith("<client>_") else f"{c}/{s}.npz")
            f.parent.mkdir(parents=True, exist_ok=True)
            np.savez(f, features=x, labels=y, sample_ids=np.array([f"{c}-{s}-{k}" for k in range(len(y))]))
    specs = import_many(tmp_path / "s", src, backbone="ext")
    assert len(specs) == 4
    for (c, s), (x, y) in data.items():
        got = load_split(tmp_path / "s", "ext", s, clients=[c])[c]
        assert got.features.tobytes() == x.tobytes() and got.labels.tolist() == y.tolist()
        assert got.sample_ids.tolist() == [f"{c}-{s}-{k}" for k in range(len(y))]


def test_a_many_client_import_is_all_or_nothing(tmp_path, monkeypatch):
    src = tmp_path / "feats"
    src.mkdir()
    for c in ("c0", "c1"):
        np.savez(src / f"{c}_train.npz", features=_client_arrays(0, 4)[0], labels=np.arange(4) % 3)
    # refused before anything is written: a file that names no client/split, a bad label, no --backbone
    (src / "README.txt").write_text("hi")
    with pytest.raises(UserError, match="README.txt: expected <client>_<train|test>"):
        import_many(tmp_path / "s", src, backbone="ext")
    (src / "README.txt").unlink()
    assert_one_line(CliRunner().invoke(ec, ["import", "--store", str(tmp_path / "s"), str(src)]), 2, "--backbone")
    np.savez(src / "c2_train.npz", features=_client_arrays(0, 4)[0], labels=np.array([0, 1, 2, 9]))
    with pytest.raises(UserError, match="c2_train.npz: labels 0..9 outside the class list"):
        import_many(tmp_path / "s", src, backbone="ext", classes=["a", "b", "c"])
    assert not (tmp_path / "s").exists()
    (src / "c2_train.npz").unlink()
    # a failure while writing the second shard undoes the first too, in an existing store
    store = tmp_path / "s"
    np.savez(tmp_path / "first.npz", features=_client_arrays(1, 3)[0], labels=np.arange(3) % 3)
    import_many(store, tmp_path / "first.npz", backbone="ext", client="c9", split="train")
    before = {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}
    real, calls = store_import.st.finalize_shard, []

    def fail_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)
    monkeypatch.setattr(store_import.st, "finalize_shard", fail_second)
    with pytest.raises(UserError, match="No space left on device.*free space"):
        import_many(store, src, backbone="ext")
    after = {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}
    assert after == before and open_store(store).clients == ("c9",)


def test_the_python_api_mirrors_import_and_export(extracted, tmp_path):
    import embedcache

    assert embedcache.export(extracted, tmp_path / "e", format="npz") == 8
    specs = embedcache.import_features(tmp_path / "e", tmp_path / "s", backbone="tiny")
    assert len(specs) == 4 and open_store(tmp_path / "s").backbones == ("tiny",)


def test_a_many_client_import_into_a_new_store_that_fails_leaves_no_store(tmp_path, monkeypatch):
    src = tmp_path / "feats"
    src.mkdir()
    for c in ("c0", "c1", "c2"):
        np.savez(src / f"{c}_train.npz", features=_client_arrays(0, 4)[0], labels=np.arange(4) % 3)
    real, calls = store_import.st.finalize_shard, []

    def fail_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(store_import.st, "finalize_shard", fail_third)
    with pytest.raises(KeyboardInterrupt):
        import_many(tmp_path / "fresh", src, backbone="ext")
    assert not (tmp_path / "fresh").exists()


def test_an_import_of_many_clients_lists_the_store_once_not_once_per_shard(tmp_path, monkeypatch):
    """Per shard, the names check listed every client of the store and the root's client list was
    rewritten: a cost that grows with the federation, per shard (quadratic in all). An import of
    many clients lists the clients a fixed number of times and writes the root's list once."""
    import numpy as np

    from embedcache.store import layout, writer
    from embedcache.store.importer import import_many

    src = tmp_path / "src"
    src.mkdir()
    for c in range(40):
        for split, n in (("train", 4), ("test", 2)):
            np.savez(src / f"c{c:03d}_{split}.npz", features=np.ones((n, 8), np.float32) * c, labels=np.arange(n) % 3)
    store = tmp_path / "s.zarr"
    import_many(store, tmp_path / "src" / "c000_train.npz", backbone="f8", client="first", split="train")
    listings, root_writes = [], []
    real_listing, real_add = layout.disk_clients, writer.add_clients
    monkeypatch.setattr(layout, "disk_clients", lambda s: listings.append(1) or real_listing(s))
    monkeypatch.setattr(writer, "add_clients", lambda s, c: root_writes.append(list(c)) or real_add(s, c))
    specs = import_many(store, src, backbone="f8")
    assert len(specs) == 80 and len(listings) <= 3 and len(root_writes) == 1
    from embedcache.store.writer import store_root

    clients = store_root(store)["clients"]
    assert clients == ["first", *(f"c{c:03d}" for c in range(40))]
