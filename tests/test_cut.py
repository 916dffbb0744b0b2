"""Cut backbones ``B@CUT`` (contract 3b): the flattened map after a stage, extracted into the
store like any feature, with the cut in the cache key; ``extract --cut``; float16 error."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import store_doubles as d
import torch
from backbone_doubles import TINY_RECIPE
from click.testing import CliRunner
from test_extract import assert_stores_equal

from embedcache.backbones import create_backbone, digitnet, list_backbones, register_backbone
from embedcache.backbones.cut import with_cut
from embedcache.cli import main
from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.manifest import save_manifest
from embedcache.store import writer as st
from embedcache.store.reader import load_split, open_store

BASE, CUT = "digitnet-builtin", "block2"


@pytest.fixture(scope="module", autouse=True)
def env(tmp_path_factory):
    """Offline, a private cache and the tiny digitnet recipe (trained once for the module)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBEDCACHE_OFFLINE", "1")
        mp.setenv("EMBEDCACHE_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.setattr(digitnet, "DEFAULT_RECIPE", TINY_RECIPE)
        yield


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return d.make_imagefolder(tmp_path_factory.mktemp("imgs"))


def _extract(images, store, source=None, **kw):
    cfg = dict(backbones=(BASE,), store=str(store), chunk_rows=4, batch_size=4, num_workers=1, progress=False)
    cfg.update(kw)
    return extract(d.make_manifest(images), ExtractConfig(**cfg), source=source or d.FolderSource(str(images)))


def test_cut_backbone_is_the_flattened_map_after_the_cut():
    base, cut = create_backbone(BASE), create_backbone(f"{BASE}@{CUT}")
    net = base.trainable()
    shape = net.stage_output_shape(CUT)
    assert cut.name == f"{BASE}@{CUT}" and cut.weights_sha256 == base.weights_sha256
    assert cut.preprocess == dict(base.preprocess, cut=CUT, map_shape=list(shape))
    assert cut.feature_dim == math.prod(shape) == 16 * 8 * 8
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(cut.embed(x), net(x, stop=CUT).flatten(1))
    from PIL import Image

    img = Image.fromarray((np.arange(48 * 40 * 3) % 251).astype(np.uint8).reshape(48, 40, 3))
    assert torch.equal(cut.transform(img), base.transform(img))
    with pytest.raises(UserError, match=f"{BASE}@{CUT}: a cut backbone only extracts maps; fine-tune {BASE}"):
        cut.trainable()


@pytest.mark.parametrize("name, match", [
    (f"{BASE}@block9", f"^{BASE}@block9: {BASE} has no cut point 'block9'; cut points: block1, block2, block3, block4$"),
    (f"{BASE}@pool", "has no cut point 'pool'"),
    (f"{BASE}@", "a cut backbone is named <backbone>@<cut>"),
    ("nope@layer1", "nope: unknown backbone"),
])
def test_bad_cut_names_are_one_line(name, match):
    with pytest.raises(UserError, match=match) as err:
        create_backbone(name)
    assert "\n" not in str(err.value)


def test_cut_of_a_backbone_that_cannot_train():
    # "tiny" (registered by store_doubles) is a duck-typed backbone without trainable()
    with pytest.raises(UserError, match="^tiny: cannot be fine-tuned"):
        create_backbone("tiny@x")
    rows = {r.name: r for r in list_backbones()}
    if rows.get("mobilenet-v2-tflite") and rows["mobilenet-v2-tflite"].available:
        with pytest.raises(UserError, match="^mobilenet-v2-tflite: cannot be fine-tuned"):
            create_backbone("mobilenet-v2-tflite@x")


def test_names_and_key():
    assert st.backbone_key(f"{BASE}@{CUT}") == f"{BASE}@{CUT}"
    assert st.backbone_key("timm:resnet18@layer2") == "timm_resnet18@layer2"
    assert with_cut(("a", "b"), "layer1") == ("a@layer1", "b@layer1") and with_cut(("a",), None) == ("a",)
    with pytest.raises(UserError, match="a@x: already names a cut; drop --cut layer1"):
        with_cut(("a@x",), "layer1")
    with pytest.raises(UserError, match="not a valid backbone name"):
        register_backbone("x@y", lambda wd, dev: None, description="")


def test_extract_cut_round_trips_to_the_staged_map(images, tmp_path):
    m = d.make_manifest(images)
    rep = _extract(images, tmp_path / "s", cut=CUT)
    assert rep.rows_computed == 30 and list(rep.per_backbone) == [f"{BASE}@{CUT}"]
    net = create_backbone(BASE).trainable()
    shape = net.stage_output_shape(CUT)
    src = d.FolderSource(str(images))
    bb = create_backbone(BASE)
    for split in ("train", "test"):
        out = load_split(tmp_path / "s", [f"{BASE}@{CUT}"], split)
        for c in m.clients:
            rows = c.train if split == "train" else c.test
            x = torch.stack([bb.transform(src.load(s.locator)) for s in rows])
            with torch.no_grad():
                want = net(x, stop=CUT).numpy()
            got = out[c.name].features.reshape(len(rows), *shape)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            assert list(out[c.name].sample_ids) == [s.id for s in rows]
    attrs = st.open_shard(tmp_path / "s", f"{BASE}@{CUT}", m.clients[0].name, "train", "r").attrs
    assert attrs["preprocess"]["cut"] == CUT and attrs["preprocess"]["map_shape"] == list(shape)
    assert (tmp_path / "s" / f"{BASE}@{CUT}").is_dir()


def test_the_cut_is_in_the_cache_key(images, tmp_path):
    store = tmp_path / "s"
    assert _extract(images, store, cut=CUT).cache_hits == 0
    rep = _extract(images, store)  # the pooled feature of the same backbone: new shards
    assert (rep.cache_hits, rep.rows_computed) == (0, 30)
    rep = _extract(images, store, cut="block3")
    assert (rep.cache_hits, rep.rows_computed) == (0, 30)
    rep = _extract(images, store, source=d.FolderSource(str(images), fail=True), backbones=(f"{BASE}@{CUT}",))
    assert (rep.cache_hits, rep.rows_computed) == (4, 0)  # --cut X and B@X are the same shards
    assert {s.backbone for s in open_store(store).shards} == {BASE, f"{BASE}@{CUT}", f"{BASE}@block3"}


def test_float16_maps_keep_11_significant_bits(images, tmp_path):
    _extract(images, tmp_path / "f32", cut=CUT)
    _extract(images, tmp_path / "f16", cut=CUT, dtype="float16")
    name = [f"{BASE}@{CUT}"]
    a, b = load_split(tmp_path / "f32", name, "train"), load_split(tmp_path / "f16", name, "train")
    for c in a:
        x, y = a[c].features.astype(np.float64), b[c].features.astype(np.float64)
        # round to nearest: half a unit in the last of 11 bits; subnormals below 2^-14 step 2^-24
        assert (np.abs(y - x) <= 2.0 ** -11 * np.abs(x) + 2.0 ** -25).all()
        assert np.abs(y - x).max() > 0  # it did round


class _FailingSource(d.FolderSource):
    """Fails on the n-th load: an extraction interrupted half-way."""

    def __init__(self, root: str, after: int) -> None:
        super().__init__(root)
        self.left = after

    def load(self, locator: str):
        self.left -= 1
        if self.left < 0:
            raise UserError(f"{locator}: disk went away")
        return super().load(locator)


def test_an_interrupted_cut_extraction_resumes_to_the_same_store(images, tmp_path):
    with pytest.raises(UserError, match="disk went away"):
        _extract(images, tmp_path / "s", source=_FailingSource(str(images), after=13), cut=CUT)
    assert not all(s.complete for s in open_store(tmp_path / "s").shards)
    rep = _extract(images, tmp_path / "s", cut=CUT)
    assert 0 < rep.rows_computed < 30
    _extract(images, tmp_path / "fresh", cut=CUT)
    assert_stores_equal(tmp_path / "s", tmp_path / "fresh")


def _errors(res) -> list[str]:
    """The `error:` lines of a CLI run (other lines are progress or notes)."""
    return [line for line in res.output.splitlines() if line.startswith("error:")]


def test_cli_cut_and_backbones_listing(images, tmp_path):
    save_manifest(d.make_manifest(images), tmp_path / "m.json")
    args = ["extract", "--manifest", str(tmp_path / "m.json"), "--store", str(tmp_path / "s"), "--quiet",
            "--batch-size", "8"]
    res = CliRunner().invoke(main, args + ["--backbones", BASE, "--cut", CUT])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, args + ["--backbones", f"{BASE}@{CUT}"])
    assert res.exit_code == 0 and "(4 cache hits), 0 chunks" in res.output
    res = CliRunner().invoke(main, args + ["--backbones", f"{BASE}@{CUT}", "--cut", "block1"])
    assert res.exit_code == 2 and _errors(res) == [f"error: {BASE}@{CUT}: already names a cut; drop --cut block1 or the @ part"]
    res = CliRunner().invoke(main, args + ["--backbones", BASE, "--cut", "pool"])
    assert res.exit_code == 2 and len(_errors(res)) == 1 and "cut points: block1, block2" in _errors(res)[0]
    listing = json.loads(CliRunner().invoke(main, ["backbones", "--json"]).output)
    rows = {r["name"]: r for r in listing["backbones"]}
    assert rows[BASE]["cut_points"] == ["block1", "block2", "block3", "block4"] and rows[BASE]["trainable"]
    assert rows["resnet20-cifar10"]["cut_points"] == ["stem", "layer1", "layer2", "layer3"]
    assert rows["mobilenet-v2-tflite"]["trainable"] is False
    table = CliRunner().invoke(main, ["backbones"]).output
    assert "stem,layer1,layer2,layer3" in table and "not trainable" in table
