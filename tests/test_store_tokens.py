"""Token states in the store (docs/contracts.md section 4): text token shards with their mask
(extracted from a paired manifest's texts, covered by the chunk digests, read back by load_split),
pooled text shards, and the token view of image cut maps."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import store_doubles as d

pytest.importorskip("tokenizers")

from text_doubles import WORDS, tiny_text_factory  # noqa: E402

from embedcache.errors import UserError  # noqa: E402
from embedcache.extraction import ExtractConfig, extract  # noqa: E402
from embedcache.manifest import Client, Manifest, Sample  # noqa: E402
from embedcache.store import writer as st  # noqa: E402
from embedcache.store.checked_reads import chunk_digest  # noqa: E402
from embedcache.store.export import export_h5  # noqa: E402
from embedcache.store.maintenance import verify_store
from embedcache.store.reader import iter_split_chunks, load_split, open_store  # noqa: E402

TOK = "tinytext@layer.1"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return d.make_imagefolder(tmp_path_factory.mktemp("imgs"))


def _paired(images, drop: str | None = None) -> Manifest:
    """The store_doubles manifest with a caption per image (sample `drop` without one)."""
    m = d.make_manifest(images)
    rng = np.random.default_rng(0)
    clients = []
    for c in m.clients:
        def cap(s: Sample) -> Sample:
            words = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 9))))
            return dataclasses.replace(s, text=None if s.id == drop else f"a photo of {words}.")
        clients.append(Client(c.name, c.domain, tuple(map(cap, c.train)), tuple(map(cap, c.test))))
    return dataclasses.replace(m, clients=tuple(clients))


def _run(manifest, images, store, names=(TOK,), **kw):
    cfg = dict(backbones=tuple(names), store=str(store), chunk_rows=3, batch_size=2, progress=False)
    cfg.update(kw)
    return extract(manifest, ExtractConfig(**cfg), source=d.FolderSource(str(images)), backbone_factory=tiny_text_factory)


def test_token_shards_hold_states_and_mask_and_read_back(images, tmp_path):
    m = _paired(images)
    rep = _run(m, images, tmp_path / "s", names=(TOK, "tinytext"))
    assert rep.rows_computed == 60 and rep.cache_hits == 0
    info = open_store(tmp_path / "s")
    tok_shards = [s for s in info.shards if s.backbone == TOK]
    assert all(s.token_shape == (12, 16) and s.modality == "text" and s.dim == 12 * 16 for s in tok_shards)
    assert all(s.token_shape is None and s.modality == "text" and s.dim == 16 for s in info.shards if s.backbone == "tinytext")
    bb, pooled = tiny_text_factory(TOK, None, "cpu"), tiny_text_factory("tinytext", None, "cpu")
    got, gp = load_split(tmp_path / "s", TOK, "train"), load_split(tmp_path / "s", "tinytext", "train")
    for c in m.clients:
        texts = [s.text for s in c.train]
        rows, mask = bb.embed_texts(texts)
        cs = got[c.name]
        assert cs.token_shape == (12, 16) and not cs.channels_first and cs.mask.dtype == np.bool_
        np.testing.assert_array_equal(cs.mask, mask.numpy())
        np.testing.assert_allclose(cs.features, rows.numpy(), rtol=0, atol=1e-6)
        toks = cs.tokens()
        assert toks.shape == (len(texts), 12, 16) and not toks[~cs.mask].any(), "masked positions hold 0"
        np.testing.assert_allclose(gp[c.name].features, pooled.embed(texts).numpy(), rtol=0, atol=1e-6)
        assert gp[c.name].mask is None and gp[c.name].token_shape is None
    assert verify_store(tmp_path / "s") == []
    attrs = st.open_shard(tmp_path / "s", TOK, "c-a", "train", "r").attrs
    assert attrs["token_shape"] == [12, 16] and attrs["modality"] == "text" and attrs["preprocess"]["cut"] == "layer.1"
    # cache hit: the texts are not tokenized again, the images not decoded
    rep = _run(m, images, tmp_path / "s", names=(TOK,))
    assert rep.cache_hits == 4 and rep.rows_computed == 0
    # a changed caption changes its split's sample-list hash, hence the cache key: that shard only
    c0 = m.clients[0]
    changed = dataclasses.replace(c0, train=(dataclasses.replace(c0.train[0], text="a dog"), *c0.train[1:]))
    rep = _run(dataclasses.replace(m, clients=(changed, *m.clients[1:])), images, tmp_path / "s", names=(TOK,))
    assert rep.cache_hits == 3 and rep.rows_computed == len(c0.train)


def test_a_sample_without_text_is_one_line_and_leaves_nothing(images, tmp_path):
    m = _paired(images, drop="b/dog/img_2.png")
    assert any(s.id == "b/dog/img_2.png" for c in m.clients for s in c.train + c.test)
    with pytest.raises(UserError, match=r"^b/dog/img_2.png: no text; tinytext@layer.1 is a text backbone") as err:
        _run(m, images, tmp_path / "s")
    assert "\n" not in str(err.value) and not (tmp_path / "s").exists()
    with pytest.raises(UserError, match="no augmented views"):
        _run(_paired(images), images, tmp_path / "s", views=2)


def test_the_mask_is_covered_by_the_chunk_digests(images, tmp_path):
    _run(_paired(images), images, tmp_path / "s")
    shard = st.open_shard(tmp_path / "s", TOK, "c-a", "train")
    mask = shard["mask"][...]
    mask[1, -1] = ~mask[1, -1]
    shard["mask"][...] = mask
    with pytest.raises(UserError, match="chunk 0: data missing or changed"):
        load_split(tmp_path / "s", TOK, "train")
    assert any("c-a/train: chunk 0 sha256 mismatch" in p for p in verify_store(tmp_path / "s"))
    with pytest.raises(UserError, match="not streamed; use load_split"):
        next(iter_split_chunks(tmp_path / "s", TOK, "test", "c-b"))


def test_digest_without_mask_is_unchanged_and_with_mask_hashes_one_byte_per_entry():
    f = np.arange(6, dtype=np.float32).reshape(2, 3)
    m = np.array([[True, False], [True, True]])
    assert chunk_digest("k", f, None) == hashlib.sha256(b"k" + f.tobytes()).digest()
    assert chunk_digest("k", f, None, m) == hashlib.sha256(b"k" + f.tobytes() + bytes([1, 0, 1, 1])).digest()


def test_masked_shards_are_loaded_alone_and_exported_with_the_mask(images, tmp_path):
    _run(_paired(images), images, tmp_path / "s", names=(TOK, "tinytext"))
    with pytest.raises(UserError, match="loaded alone, not concatenated with tinytext"):
        load_split(tmp_path / "s", [TOK, "tinytext"], "train")
    import h5py

    export_h5(tmp_path / "s", tmp_path / "s.h5")
    with h5py.File(tmp_path / "s.h5") as f:
        key = f"{st.backbone_key(TOK)}/c-a/train"
        assert f[key]["mask"].shape == (f[key]["features"].shape[0], 12) and "mask" not in f["tinytext/c-a/train"]


def test_dask_workers_write_the_same_text_shards(images, tmp_path, monkeypatch):
    """The worker function (embedcache.distributed.run_chunk_job) writes what the local runner
    writes; run in-process here instead of on a cluster."""
    import embedcache.distributed as dist
    import embedcache.extraction as ex

    m = _paired(images)
    _run(m, images, tmp_path / "a")
    monkeypatch.setattr(ex._LazyClient, "get", lambda self: None)
    monkeypatch.setattr(dist, "run_dask", lambda jobs, client, bar: [dist.run_chunk_job(j) for j in jobs])
    _run(m, images, tmp_path / "b", scheduler="local:1")
    for s in open_store(tmp_path / "a").shards:
        ga, gb = (st.open_shard(p, s.backbone, s.client, s.split, "r") for p in (tmp_path / "a", tmp_path / "b"))
        for arr in ("features", "mask", "done"):
            assert ga[arr][...].tobytes() == gb[arr][...].tobytes(), (s.path, arr)


def test_image_cut_maps_read_as_tokens(tmp_path):
    """A [C, H, W] map stored C-major: token h*W + w has the C channels at (h, w)."""
    n, c, h, w = 5, 3, 2, 4
    maps = np.random.default_rng(0).standard_normal((n, c, h, w)).astype(np.float32)
    st.init_store(tmp_path, ["x", "y"], "mh", ["c0"])
    spec = st.ShardSpec(backbone="img@cut", weights_sha256="0" * 64, preprocess={"cut": "cut", "map_shape": [c, h, w]},
                        feature_dim=c * h * w, client="c0", split="train", domain="d", manifest_hash="mh",
                        sample_list_hash="s", sample_ids=tuple(f"i{k}" for k in range(n)), labels=(0, 1, 0, 1, 0),
                        chunk_rows=2)
    st.write_shard(tmp_path, spec, maps.reshape(n, -1))
    cs = load_split(tmp_path, "img@cut", "train")["c0"]
    assert cs.token_shape == (h * w, c) and cs.channels_first and cs.mask is None
    toks = cs.tokens()
    assert toks.shape == (n, h * w, c) and toks.flags.c_contiguous
    for i, hh, ww in ((0, 0, 0), (3, 1, 2), (4, 1, 3)):
        np.testing.assert_array_equal(toks[i, hh * w + ww], maps[i, :, hh, ww])
    assert not np.array_equal(toks, cs.features.reshape(n, h * w, c)), "the plain reshape is not the token view"
    with pytest.raises(UserError, match="mask shape None"):
        st.write_shard(tmp_path, dataclasses.replace(spec, backbone="t@x", preprocess={}, token_shape=(c * h, w)),
                       maps.reshape(n, -1))


def test_float16_token_shards_keep_the_stated_error_and_an_exact_mask(images, tmp_path):
    """contract 4: `--dtype float16` rounds each state to 11 significant bits (relative <= 4.9e-4,
    absolute <= 3e-8 near 0); the mask is stored as bools, exactly."""
    m = _paired(images)
    _run(m, images, tmp_path / "h", dtype="float16")
    _run(m, images, tmp_path / "f")
    half, full = load_split(tmp_path / "h", TOK, "train"), load_split(tmp_path / "f", TOK, "train")
    assert open_store(tmp_path / "h").shards[0].dtype == "float16"
    for c in m.clients:
        h, f = half[c.name], full[c.name]
        assert h.features.dtype == np.float32 and np.array_equal(h.mask, f.mask)
        err = np.abs(h.features - f.features)
        assert (err <= np.maximum(2.0 ** -11 * np.abs(f.features), 3e-8)).all()
        assert err.max() > 0, "float16 storage must actually round"
        assert not h.tokens()[~h.mask].any()


def test_cli_extracts_token_shards_from_a_manifests_texts(images, tmp_path):
    """`embedcache extract --backbones <text backbone>@<cut>` over a paired manifest, then verify."""
    from click.testing import CliRunner

    from embedcache.cli import main
    from embedcache.manifest import save_manifest

    m = _paired(images)
    save_manifest(m, tmp_path / "m.json")
    args = ["extract", "--manifest", str(tmp_path / "m.json"), "--backbones", f"{TOK},tinytext", "--store",
            str(tmp_path / "s"), "--plugin", "text_plugin", "--quiet",
            "--chunk-rows", "4", "--batch-size", "3"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    got = load_split(tmp_path / "s", TOK, "test")
    bb = tiny_text_factory(TOK, None, "cpu")
    for c in m.clients:
        rows, mask = bb.embed_texts([s.text for s in c.test])
        np.testing.assert_array_equal(got[c.name].mask, mask.numpy())
        np.testing.assert_allclose(got[c.name].features, rows.numpy(), rtol=0, atol=1e-6)
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "s")]).exit_code == 0
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0 and "0 chunks" in res.output, res.output
