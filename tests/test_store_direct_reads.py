"""Checked reads without zarr objects (embedcache.store.chunk_files, layout.StoreNodes): the rows
are those zarr reads, of every array the writer makes (multi-chunk, edge chunk, views, a token
mask, float16, never-written all-zero chunks); arrays in another layout go through zarr; every
damage is still refused; stores without consolidated metadata (or with a damaged one) read the
same; and reading many small shards opens no zarr group at all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from embedcache.errors import UserError
from embedcache.store import layout
from embedcache.store import writer as st
from embedcache.store.chunk_files import ChunkFiles
from embedcache.store.reader import iter_split_chunks, load_split, open_store


def _spec(backbone: str, client: str, n: int, d: int, **kw) -> st.ShardSpec:
    return st.ShardSpec(backbone=backbone, weights_sha256="0" * 64, preprocess={}, feature_dim=d, client=client,
                        split="train", domain="d", manifest_hash="m", sample_list_hash=f"{backbone}-{client}",
                        sample_ids=tuple(f"{client}/é{i}" for i in range(n)), labels=tuple(i % 3 for i in range(n)),
                        **kw)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """One shard of each kind the writer makes; chunk_rows 4, so most end in a partial chunk."""
    rng = np.random.default_rng(0)
    root = tmp_path / "s"
    st.init_store(root, ["a", "b", "c"], "m", clients=["c0", "c1", "c2"])
    x = rng.normal(size=(11, 6)).astype(np.float32)
    x[4:8] = 0  # chunk 1 equals the fill value: zarr writes no file for it
    st.write_shard(root, _spec("plain", "c0", 11, 6, chunk_rows=4), x)
    st.write_shard(root, _spec("plain", "c1", 1, 6, chunk_rows=4), x[:1])
    st.write_shard(root, _spec("plain", "c2", 9, 6, chunk_rows=4, dtype="float16"), x[:9])
    v = rng.normal(size=(2, 7, 6)).astype(np.float32)
    for c in ("c0", "c1", "c2"):
        st.write_shard(root, _spec("views", c, 7, 6, chunk_rows=4, views=2), x[:7], views=v)
        st.write_shard(root, _spec("tok", c, 5, 6, chunk_rows=4, token_shape=(3, 2)), x[:5],
                       mask=rng.random((5, 3)) > 0.3)
    st.consolidate(root)
    return root


def _zarr_rows(store: Path, path: str, name: str) -> np.ndarray:
    return np.asarray(zarr.open_group(str(store), mode="r", zarr_format=3, use_consolidated=False)[path][name][...])


def test_every_array_the_writer_makes_is_read_from_its_files_as_zarr_reads_it(store):
    info = open_store(store)
    nodes = info.nodes()
    for sh in info.shards:
        names = ["features", "labels", "sample_ids", *(["views"] if sh.views > 1 else []),
                 *(["mask"] if sh.token_shape else [])]
        for name in names:
            files = ChunkFiles.parse(str(store / sh.path / name), nodes.get(f"{sh.path}/{name}"),
                                     1 if name == "views" else 0)
            assert files is not None, (sh.path, name)
            cr = files.chunks[files.row_axis]
            got = files.read(0, -(-sh.n // cr))
            want = _zarr_rows(store, sh.path, name)
            assert got.shape == want.shape and got.dtype.kind == want.dtype.kind or name == "sample_ids"
            assert np.asarray(got).tolist() == np.asarray(want).tolist(), (sh.path, name)
    for b in ("plain", "views", "tok"):
        for split in load_split(info, b, "train", views=b == "views").values():
            assert split.features.flags.writeable  # callers may normalise in place, as with zarr's arrays
    cs = load_split(info, "views", "train", views=True)["c1"]
    np.testing.assert_array_equal(cs.views, _zarr_rows(store, "views/c1/train", "views").astype(np.float32))
    tok = load_split(info, "tok", "train")["c2"]
    np.testing.assert_array_equal(tok.mask, _zarr_rows(store, "tok/c2/train", "mask"))
    assert load_split(info, "plain", "train")["c0"].sample_ids.tolist() == [f"c0/é{i}" for i in range(11)]


def test_many_small_shards_are_read_without_opening_a_zarr_group(store, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a zarr group was opened")

    monkeypatch.setattr(zarr, "open_group", refuse)  # zarr.open_group(...) is how layout opens a store
    monkeypatch.setattr(zarr, "open_array", refuse)
    info = open_store(store)
    rows = sum(len(y) for c in info.clients for _, y, _ in iter_split_chunks(info, "plain", "train", c, 3))
    assert rows == 11 + 1 + 9
    assert sorted(load_split(info, "tok", "train")) == ["c0", "c1", "c2"]


def test_an_array_in_another_layout_is_read_and_checked_through_zarr(store):
    """The same values under another codec (gzip): the direct reader declines it, zarr reads it, the
    digests (of the values, not the bytes) still hold, and a deleted chunk is still refused."""
    path = "plain/c0/train"
    want = load_split(store, "plain", "train")["c0"].features
    g = zarr.open_group(str(store / path), mode="r+", zarr_format=3)
    data = np.asarray(g["features"][...])
    shutil.rmtree(store / path / "features")
    g.create_array("features", shape=data.shape, chunks=(4, 6), dtype="float32", fill_value=0,
                   compressors=zarr.codecs.GzipCodec())[...] = data
    st.consolidate(store)
    info = open_store(store)
    assert ChunkFiles.parse(str(store / path / "features"), info.nodes().get(f"{path}/features")) is None
    np.testing.assert_array_equal(load_split(info, "plain", "train")["c0"].features, want)
    (store / path / "features" / "c" / "2" / "0").unlink()
    with pytest.raises(UserError, match="plain/c0/train chunk 2: data missing or changed"):
        load_split(store, "plain", "train", clients=["c0"])


@pytest.mark.parametrize("damage", ["other-values", "truncated", "deleted", "ids"])
def test_damaged_chunk_files_are_refused_on_the_direct_path(store, damage):
    path = store / "plain" / "c0" / "train"
    if damage == "other-values":  # a valid zstd frame of other values: decodes, fails its digest
        chunk = path / "features" / "c" / "2" / "0"
        x = np.frombuffer(st_decode(chunk), np.float32).copy()
        x[0] += 1
        chunk.write_bytes(_zstd(x.tobytes()))
        match = "chunk 2: data missing or changed"
    elif damage == "truncated":
        chunk = path / "features" / "c" / "0" / "0"
        chunk.write_bytes(chunk.read_bytes()[:-7])
        match = "cannot read rows 0"
    elif damage == "deleted":
        (path / "labels" / "c" / "0").unlink()
        match = "chunk 0: data missing or changed"
    else:
        chunk = path / "sample_ids" / "c" / "1"
        from numcodecs.vlen import VLenUTF8

        ids = np.array([f"c0/é{i}" for i in range(4, 8)], dtype=object)
        ids[1] = "someone-else"
        chunk.write_bytes(_zstd(bytes(VLenUTF8().encode(ids))))
        match = "chunk 1: data missing or changed"
    with pytest.raises(UserError, match=match):
        load_split(store, "plain", "train", clients=["c0"])
    with pytest.raises(UserError, match=match):
        list(iter_split_chunks(store, "plain", "train", "c0", chunk_rows=5))
    assert load_split(store, "plain", "train", clients=["c1", "c2"])["c2"].features.shape == (9, 6)


def st_decode(chunk: Path) -> bytes:
    from numcodecs.zstd import Zstd

    return bytes(Zstd().decode(chunk.read_bytes()))


def _zstd(raw: bytes) -> bytes:
    from numcodecs.zstd import Zstd

    return bytes(Zstd().encode(raw))


def test_a_store_without_consolidated_metadata_reads_the_same(store):
    want = {b: load_split(store, b, "train", views=b == "views") for b in ("plain", "views", "tok")}
    layout.drop_consolidated(store)
    info = open_store(store)
    assert not info.consolidated and not info.nodes().consolidated
    for b, splits in want.items():
        got = load_split(info, b, "train", views=b == "views")
        for c, cs in splits.items():
            np.testing.assert_array_equal(got[c].features, cs.features)
            assert got[c].sample_ids.tolist() == cs.sample_ids.tolist()


def test_a_consolidated_entry_that_is_no_node_is_not_trusted(store):
    meta = json.loads((store / "zarr.json").read_text())
    meta["consolidated_metadata"]["metadata"]["plain/c0/train/features"] = "garbage"
    (store / "zarr.json").write_text(json.dumps(meta))
    assert "plain/c0/train/features is not a node's metadata" in (layout.consolidated_problem(store, meta) or "")
    with pytest.warns(Warning, match="consolidated metadata is unreadable"):
        info = open_store(store)
    assert not info.consolidated
    assert load_split(info, "plain", "train")["c0"].features.shape == (11, 6)


def test_a_prefix_of_a_zstd_frame_is_its_first_bytes():
    """zstd_prefix: the first k bytes of the content; a frame cut short gives fewer bytes or a
    ValueError; garbage is a ValueError (the reader: `cannot read`)."""
    from numcodecs.zstd import Zstd

    from embedcache.store import zstd_prefix

    content = np.random.default_rng(0).normal(size=(256, 300)).astype(np.float32)
    content[3:] = 0  # a padded edge chunk: mostly zeros after the first rows
    frame = bytes(Zstd().encode(content.tobytes()))
    for rows in (1, 3, 200, 256):
        out = np.empty((rows, 300), np.float32)
        assert zstd_prefix.decode_prefix(frame, out) == out.nbytes
        np.testing.assert_array_equal(out, content[:rows])
    big = np.empty((300, 300), np.float32)
    assert zstd_prefix.decode_prefix(frame, big) == content.nbytes  # the content is shorter
    try:
        assert zstd_prefix.decode_prefix(frame[: len(frame) // 2], np.empty_like(content)) < content.nbytes
    except ValueError:
        pass  # a truncated frame: refused, never returned whole
    with pytest.raises(ValueError):
        zstd_prefix.decode_prefix(b"\x28\xb5\x2f\xfd" + b"\xff" * 40, np.empty(100, np.uint8))


def test_a_whole_zstd_frame_decodes_as_numcodecs_decodes_it():
    from numcodecs.zstd import Zstd

    from embedcache.store import zstd_prefix

    for content in (b"x", "é".encode() * 1000, np.arange(5000).tobytes()):
        assert zstd_prefix.decode(bytes(Zstd().encode(content))) == content
    with pytest.raises(ValueError):
        zstd_prefix.decode(b"\x28\xb5\x2f\xfd" + b"\xff" * 40)
