"""Paired image-text data (docs/contracts.md 2a): generated captions read off the pixels,
`captioned:` sources, user captions from captions.tsv, and partition writing them into the
manifest (`--preset feddra`, feature shift by a fraction)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from store_doubles import make_imagefolder

from embedcache.cli import main
from embedcache.errors import UserError
from embedcache.manifest import load_manifest, manifest_to_json
from embedcache.partitioning import Recipe, partition
from embedcache.sources import open_source
from embedcache.sources.captions import CAPTION_VERSION, TEMPLATES, attributes, caption_for, synonyms


def _img(w: int, h: int, border: tuple, centre: tuple, noise: bool = False) -> Image.Image:
    px = np.empty((h, w, 3), np.uint8)
    px[:] = border
    if noise:
        px[:] = np.random.default_rng(0).integers(0, 256, (h, w, 3))
    px[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = centre
    return Image.fromarray(px)


@pytest.mark.parametrize("img, want", [
    (_img(60, 30, (255, 255, 255), (210, 20, 25)),
     {"orientation": "landscape", "background": "white", "colour": "red", "lighting": "bright"}),
    (_img(30, 60, (5, 5, 5), (40, 80, 200)),
     {"orientation": "portrait", "background": "dark", "colour": "blue", "lighting": "dim"}),
    (_img(40, 40, (128, 128, 128), (125, 82, 38)),
     {"orientation": "square", "background": "plain", "colour": "brown", "lighting": "soft"}),
    (_img(40, 44, (0, 0, 0), (230, 200, 40), noise=True),
     {"orientation": "square", "background": "cluttered", "colour": "yellow", "lighting": "soft"}),
])
def test_attributes_read_off_the_pixels(img, want):
    assert attributes(img) == want


def test_captions_are_deterministic_and_use_every_template_and_synonym():
    rng = np.random.default_rng(1)
    imgs = [Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)) for _ in range(80)]
    caps = [caption_for(im, "mug", "amazon") for im in imgs]
    assert caps == [caption_for(im.copy(), "mug", "amazon") for im in imgs]  # pixels, not object identity
    assert all("online product photo" in c and "cluttered background" in c for c in caps)
    used_syn = Counter(next(s for s in ("coffee mug", "cup", "mug") if s in c) for c in caps)
    assert set(used_syn) == {"mug", "coffee mug", "cup"}
    kinds = Counter(0 if re.match(r"a \w+, ", c) else 1 if " against a " in c else 2 if ": " in c
                    else 3 if c.startswith("there is ") else -1 for c in caps)
    assert set(kinds) == {0, 1, 2, 3} and len(TEMPLATES) == 4
    assert len(set(caps)) > 10
    # one pixel more changes the hash, so (often) the choices; the class always changes the noun
    assert caption_for(imgs[0], "bike", "amazon") != caps[0]


def test_fallback_words_for_other_classes_and_domains():
    im = _img(40, 40, (255, 255, 255), (20, 20, 20))
    cap = caption_for(im, "zebra_fish", "clinic-a")
    assert "zebra fish" in cap and "clinic a image" in cap and "black" in cap
    assert synonyms("7") == ("digit 7", "number 7", "numeral 7")
    assert len(synonyms("headphones")) == 3


@pytest.fixture()
def folder(tmp_path) -> Path:
    return make_imagefolder(tmp_path / "img", domains=("amazon", "caltech10", "webcam"), classes=("bike", "mug"),
                            per_class=5, size=12)


def test_captioned_source_wraps_any_source(folder):
    src = open_source(f"captioned:imagefolder:{folder}")
    inner = open_source(f"imagefolder:{folder}")
    assert src.caption_origin == f"generated/{CAPTION_VERSION}" and inner.caption_origin is None
    assert src.index() == inner.index() and src.classes() == inner.classes() and src.domains() == inner.domains()
    loc = "caltech10/mug/img_2.png"
    assert src.fingerprint(loc, "sha256") == inner.fingerprint(loc, "sha256")
    assert src.caption(loc) == caption_for(inner.load(loc), "mug", "caltech10")
    with pytest.raises(UserError, match="not a sample"):
        src.caption("caltech10/mug/nope.png")
    for bad in ("captioned:", "captioned:captioned:builtin:digits", "captioned:nowhere:x"):
        with pytest.raises(UserError):
            open_source(bad)


def test_partition_writes_the_captions_into_the_manifest(folder, tmp_path):
    spec = f"captioned:imagefolder:{folder}"
    m = partition(open_source(spec), Recipe("label-shift", clients=2, train_fraction=0.5), seed=0)
    assert m.paired and m.recipe["captions"] == f"generated/{CAPTION_VERSION}" and m.source == spec
    src = open_source(spec)
    assert all(s.text == src.caption(s.locator) for s in m.all_samples())
    again = partition(open_source(spec), Recipe("label-shift", clients=2, train_fraction=0.5), seed=0)
    assert manifest_to_json(again) == manifest_to_json(m)
    plain = partition(open_source(f"imagefolder:{folder}"), Recipe("label-shift", clients=2, train_fraction=0.5),
                      seed=0)
    assert not plain.paired and "captions" not in plain.recipe  # manifests without texts are as before
    assert [s.id for s in plain.all_samples()] == [s.id for s in m.all_samples()]
    assert len(json.loads(manifest_to_json(plain))["clients"][0]["train"][0]) == 4


def _tsv(folder: Path, lines: list[str]) -> None:
    (folder / "captions.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_user_captions_from_captions_tsv(folder):
    locs = [loc for _, loc, _ in open_source(f"imagefolder:{folder}").index()]
    _tsv(folder, ["locator\ttext", "# a comment", ""] + [f"{loc}\tphoto n\u00b0{k}" for k, loc in enumerate(locs)]
         + ["amazon/bike/typo.png\tlost"])
    src = open_source(f"imagefolder:{folder}")
    assert src.caption_origin.startswith("captions.tsv:") and src.caption(locs[3]) == "photo n\u00b03"
    m = partition(src, Recipe("feature-shift", train_per_class=2), seed=0)
    assert m.paired and m.recipe["captions"] == src.caption_origin
    assert any("1 caption line(s) name no image" in w for w in m.report["warnings"])
    # generated captions win when asked for
    assert open_source(f"captioned:imagefolder:{folder}").caption(locs[3]) != "photo n\u00b03"


@pytest.mark.parametrize("lines, match", [
    (["amazon/bike/img_0.png photo"], r"captions.tsv:1: expected <locator><TAB><text>"),
    (["amazon/bike/img_0.png\ta", "amazon/bike/img_0.png\tb"], r"captions.tsv:2: .*has a caption already"),
    (["amazon/bike/img_0.png\t  "], r"captions.tsv:1: .*empty caption"),
])
def test_bad_captions_tsv_names_the_line(folder, lines, match):
    _tsv(folder, lines)
    with pytest.raises(UserError, match=match):
        open_source(f"imagefolder:{folder}").caption("amazon/bike/img_0.png")


def test_a_sample_without_a_caption_is_one_line(folder, tmp_path):
    _tsv(folder, ["amazon/bike/img_0.png\ta bike"])
    out = tmp_path / "m.json"
    res = CliRunner().invoke(main, ["partition", f"imagefolder:{folder}", "--scheme", "feature-shift",
                                    "--train-per-class", "2", "--out", str(out)])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "have no text" in res.output, res.output
    assert "no caption in" in res.output and not out.exists()


def test_preset_feddra(folder, tmp_path):
    out = tmp_path / "m.json"
    res = CliRunner().invoke(main, ["partition", f"captioned:imagefolder:{folder}", "--preset", "feddra",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    m = load_manifest(out)
    r = m.recipe
    assert (r["scheme"], r["clients"], r["alpha"], r["train_fraction"], r["domains"]) == \
        ("label-shift", 5, 1.0, 0.8, ["amazon", "caltech10"])
    assert m.paired and {s.locator.split("/")[0] for s in m.all_samples()} == {"amazon", "caltech10"}
    assert "distinct texts" in res.output
    res = CliRunner().invoke(main, ["partition", f"imagefolder:{folder}", "--preset", "feddra",
                                    "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "has no texts" in res.output
    res = CliRunner().invoke(main, ["partition", f"captioned:imagefolder:{folder}", "--preset", "feddra",
                                    "--domains", "webcam", "--clients", "2", "--out", str(out)])
    assert res.exit_code == 0 and load_manifest(out).recipe["domains"] == ["webcam"]


def test_feature_shift_by_fraction(folder):
    src = open_source(f"imagefolder:{folder}")
    m = partition(src, Recipe("feature-shift", train_fraction=0.8, domains=("amazon", "caltech10")), seed=0)
    assert [c.domain for c in m.clients] == ["amazon", "caltech10"]
    for c in m.clients:
        assert Counter(s.label for s in c.train) == {0: 4, 1: 4} and Counter(s.label for s in c.test) == {0: 1, 1: 1}
    assert m.recipe["train_per_class"] is None and m.recipe["train_fraction"] == 0.8
    with pytest.raises(UserError, match="--train-per-class and --train-fraction"):
        partition(src, Recipe("feature-shift", train_fraction=0.8, train_per_class=3), seed=0)
    assert partition(src, Recipe("feature-shift"), seed=0).recipe["train_fraction"] is None


def test_committed_feddra_manifest_is_reproduced(shared, monkeypatch, tmp_path):
    """The example under data_manifests/ comes out byte for byte from its documented command:
    a caption generator change that alters any caption must bump CAPTION_VERSION (and the examples)."""
    repo = Path(__file__).resolve().parents[1]
    if shared.resolve() != (repo.parent / "shared").resolve():
        pytest.skip("the example's source path is ../shared relative to the repository")
    monkeypatch.chdir(repo)
    want = repo / "data_manifests" / "office10-feddra-5clients-seed0.json"
    res = CliRunner().invoke(main, ["partition", "captioned:imagefolder:../shared/data/office_caltech10", "--preset",
                                    "feddra", "--seed", "0", "--fingerprint", "sha256", "--out", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "m.json").read_bytes() == want.read_bytes()
    m = load_manifest(want)
    assert m.paired and m.recipe["captions"] == f"generated/{CAPTION_VERSION}"
    assert sorted(len(c.train) + len(c.test) for c in m.clients) == [317, 395, 407, 465, 497]
