"""Fingerprints: images that change after `embedcache partition` are never served from the
cache: extract refuses naming them, a re-partition re-extracts them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import store_doubles as d
from click.testing import CliRunner
from PIL import Image

from embedcache.cli import main
from embedcache.errors import UserError
from embedcache.manifest import load_manifest, manifest_from_dict
from embedcache.partitioning import Recipe, partition
from embedcache.sources import open_source
from embedcache.sources.drift import check_unchanged, find_changes
from embedcache.store.reader import load_split


def _partition(root: Path, out: Path, *extra: str) -> None:
    res = CliRunner().invoke(main, ["partition", f"imagefolder:{root}", "--scheme", "feature-shift",
                                    "--train-per-class", "2", "--out", str(out), *extra])
    assert res.exit_code == 0, res.output


def _extract(manifest: Path, store: Path):
    return CliRunner().invoke(main, ["extract", "--manifest", str(manifest), "--backbones", "tiny", "--store",
                                     str(store), "--plugin", "store_doubles", "--quiet", "--batch-size", "2"])


def test_blackened_domain_is_refused_then_re_extracted_after_re_partition(tmp_path):
    root = d.make_imagefolder(tmp_path / "imgs")
    m, store = tmp_path / "m.json", tmp_path / "s"
    _partition(root, m)
    assert all(s.fingerprint for s in load_manifest(m).all_samples())
    assert _extract(m, store).exit_code == 0
    before = load_split(store, "tiny", "train")
    victims = sorted((root / "a").rglob("*.png"))
    for f in victims:  # same names, black pixels
        w, h = Image.open(f).size
        Image.new("RGB", (w, h)).save(f)
    res = _extract(m, store)
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert f"{len(victims)} images changed since the manifest was written" in res.output
    assert re.search(r"\(e\.g\. a/cat/img_\d\.png: content changed \(sha256 [0-9a-f]{8} -> [0-9a-f]{8}\), ",
                     res.output), res.output
    assert "re-run the same `embedcache partition`" in res.output
    assert "cache hits" not in res.output
    # the same command records the images as they are now: new cache keys, domain a re-extracted
    _partition(root, m)
    res = _extract(m, store)
    assert res.exit_code == 0 and "(2 cache hits)" in res.output, res.output  # domain b's two shards
    after = load_split(store, "tiny", "train")
    assert np.array_equal(after["c01-b"].features, before["c01-b"].features)
    assert not np.allclose(after["c00-a"].features, before["c00-a"].features)
    black = d.TinyBackbone("tiny")
    x = black.transform(Image.new("RGB", (10, 10)))[None]
    np.testing.assert_allclose(after["c00-a"].features[0], black.embed(x)[0].numpy(), rtol=1e-6)


def test_missing_image_is_named(tmp_path):
    root = d.make_imagefolder(tmp_path / "imgs")
    _partition(root, tmp_path / "m.json")
    (root / "b" / "dog" / "img_3.png").unlink()
    with pytest.raises(UserError, match=r"^1 image changed .*b/dog/img_3.png: image file missing"):
        check_unchanged(load_manifest(tmp_path / "m.json"))


def _ppm_folder(root: Path) -> Path:
    """Uncompressed images: a pixel edit keeps the file size."""
    for c in ("cat", "dog"):
        (root / "a" / c).mkdir(parents=True)
        for k in range(3):
            Image.new("RGB", (4, 4), (k * 40, 10, 10)).save(root / "a" / c / f"{k}.ppm")
    return root


def test_sha256_kind_sees_a_same_size_same_mtime_edit(tmp_path):
    root = _ppm_folder(tmp_path / "imgs")
    src = open_source(f"imagefolder:{root}")
    by_stat = partition(src, Recipe("feature-shift", train_per_class=1, fingerprint="stat"), seed=0)
    by_hash = partition(src, Recipe("feature-shift", train_per_class=1), seed=0)  # the default kind
    assert by_hash.recipe["fingerprint"] == "sha256" and by_hash.content_hash != by_stat.content_hash
    assert by_hash.sample_list_hash("c00-a", "train") != by_stat.sample_list_hash("c00-a", "train")
    f = root / "a" / "dog" / "1.ppm"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert find_changes(by_stat) == []  # the documented limit of the cheap kind
    changes = find_changes(by_hash)
    assert [c.locator for c in changes] == ["a/dog/1.ppm"]
    with pytest.raises(UserError, match=r"a/dog/1.ppm: content changed \(sha256 "):
        check_unchanged(by_hash)


# Written by the code before fingerprints (3-element rows); hash taken with that code.
OLD = {"format": "embedcache-manifest/1", "source": "imagefolder:IMGS", "classes": ["cat", "dog"], "seed": 0,
       "recipe": {"scheme": "hand"}, "report": {},
       "clients": [{"name": "c0-a", "domain": "a", "train": [["a/cat/0.png", "a/cat/0.png", 0],
                                                             ["a/dog/0.png", "a/dog/0.png", 1]],
                    "test": [["a/cat/1.png", "a/cat/1.png", 0]]}],
       "content_hash": "c7156cace8f8f87f5e81d6c1f0dcb20ff61091183adf37a5941d777954f7ae82"}


def test_old_manifest_keeps_its_hashes_and_extract_says_drift_is_undetectable(tmp_path):
    m = manifest_from_dict(json.loads(json.dumps(OLD)))
    assert m.content_hash == OLD["content_hash"]  # and so the cache keys of stores built from it
    assert m.sample_list_hash("c0-a", "train") == "545a43ee0750908d3b847a013fd77dec5d547eac491c3e11d0bc9eaf04df1c7c"
    assert all(s.fingerprint == "" for s in m.all_samples())
    root = tmp_path / "imgs"
    for loc in ("a/cat/0.png", "a/dog/0.png", "a/cat/1.png"):
        (root / loc).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (1, 2, 3)).save(root / loc)
    doc = dict(OLD, source=f"imagefolder:{root}")
    del doc["content_hash"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    res = _extract(tmp_path / "old.json", tmp_path / "s")
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "no image fingerprints" in notes[0] and "embedcache partition" in notes[0]


def test_fingerprints_are_reproducible_and_part_of_the_bytes(tmp_path):
    root = d.make_imagefolder(tmp_path / "imgs")
    _partition(root, tmp_path / "m1.json", "--fingerprint", "stat")
    _partition(root, tmp_path / "m2.json", "--fingerprint", "stat")
    assert (tmp_path / "m1.json").read_bytes() == (tmp_path / "m2.json").read_bytes()
    row = json.loads((tmp_path / "m1.json").read_text())["clients"][0]["train"][0]
    size, mtime = row[3].split(":")
    assert int(size) == (root / row[1]).stat().st_size and int(mtime) == (root / row[1]).stat().st_mtime_ns
    os.utime(root / row[1], ns=(0, int(mtime) + 1))
    _partition(root, tmp_path / "m3.json", "--fingerprint", "stat")  # same command, touched file: a different manifest
    assert load_manifest(tmp_path / "m3.json").content_hash != load_manifest(tmp_path / "m1.json").content_hash


def test_builtin_digits_fingerprints_pixels():
    src = open_source("builtin:digits")
    a, b = src.fingerprint("uci/0"), src.fingerprint("uci/1")
    assert len(a) == 32 and a != b and a == open_source("builtin:digits").fingerprint("uci/0", "sha256")
    with pytest.raises(UserError, match="uci/999999"):
        src.fingerprint("uci/999999")


def test_jda_digits_fingerprint_follows_the_file(shared, tmp_path):
    from scipy.io import loadmat, savemat

    mat = shared / "data" / "digits_mnist_usps" / "MNIST_vs_USPS.mat"
    if not mat.is_file():
        pytest.skip(f"{mat} not present")
    data = {k: v for k, v in loadmat(str(mat)).items() if not k.startswith("__")}
    savemat(str(tmp_path / "m.mat"), data)
    src = open_source(f"jda-digits:{tmp_path / 'm.mat'}")
    fp = src.fingerprint("usps/7")
    assert fp.endswith(":7") and fp != src.fingerprint("usps/8")
    data["X_tar"][:, 7] = 0  # one image blanked
    savemat(str(tmp_path / "m.mat"), data)
    assert open_source(f"jda-digits:{tmp_path / 'm.mat'}").fingerprint("usps/7") != fp


def test_verify_with_the_manifest_sees_changed_images_and_foreign_shards(tmp_path):
    root = d.make_imagefolder(tmp_path / "imgs")
    m, store = tmp_path / "m.json", tmp_path / "s"
    _partition(root, m)
    assert _extract(m, store).exit_code == 0
    ok = CliRunner().invoke(main, ["verify", str(store), "--manifest", str(m)])
    assert ok.exit_code == 0, ok.output
    for f in sorted((root / "a").rglob("*.png")):
        Image.new("RGB", Image.open(f).size).save(f)
    bad = CliRunner().invoke(main, ["verify", str(store), "--manifest", str(m)])
    assert bad.exit_code == 1
    assert re.search(r"problem: \d+ image\(s\) changed since the manifest was written", bad.output), bad.output
    # a re-partitioned manifest no longer matches domain a's shards until they are re-extracted
    m2 = tmp_path / "m2.json"
    _partition(root, m2)
    other = CliRunner().invoke(main, ["verify", str(store), "--manifest", str(m2)])
    assert other.exit_code == 1 and "tiny/c00-a/train: holds other samples" in other.output, other.output
    assert "c01-b" not in other.output
    assert _extract(m2, store).exit_code == 0
    assert CliRunner().invoke(main, ["verify", str(store), "--manifest", str(m2)]).exit_code == 0


def _replace_keeping_size_and_mtime(victim: Path, other: Path) -> None:
    """What `cp -p` / `rsync -t` of another image of the same size under the old name leaves."""
    st = victim.stat()
    shutil.copyfile(other, victim)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert victim.stat().st_size == st.st_size and victim.stat().st_mtime_ns == st.st_mtime_ns


def test_default_kind_is_content_and_refuses_a_same_size_replacement_with_its_mtime_kept(tmp_path):
    root = _ppm_folder(tmp_path / "imgs")
    m, store = tmp_path / "m.json", tmp_path / "s"
    _partition(root, m)  # no --fingerprint
    man = load_manifest(m)
    assert man.fingerprint_kind == "sha256" and man.recipe["fingerprint"] == "sha256"
    row = next(s for s in man.all_samples() if s.locator == "a/dog/1.ppm")
    assert row.fingerprint == hashlib.sha256((root / "a/dog/1.ppm").read_bytes()).hexdigest()
    res = _extract(m, store)
    assert res.exit_code == 0 and "note:" not in res.output, res.output
    _replace_keeping_size_and_mtime(root / "a/dog/1.ppm", root / "a/dog/2.ppm")
    res = _extract(m, store)  # every shard would be a cache hit: refused before any
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "1 image changed since the manifest was written (e.g. a/dog/1.ppm: content changed (sha256 " \
        in res.output, res.output


def test_stat_is_an_opt_in_that_keeps_working_and_says_what_it_misses(tmp_path):
    root = _ppm_folder(tmp_path / "imgs")
    m, store = tmp_path / "m.json", tmp_path / "s"
    _partition(root, m, "--fingerprint", "stat")
    man = load_manifest(m)
    assert man.fingerprint_kind == "stat" and all(re.fullmatch(r"\d+:\d+", s.fingerprint) for s in man.all_samples())
    res = _extract(m, store)
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "size + modification time" in notes[0] and "cp -p" in notes[0], res.output
    assert "--fingerprint sha256" in notes[0]
    _replace_keeping_size_and_mtime(root / "a/dog/1.ppm", root / "a/dog/2.ppm")
    assert find_changes(man) == []  # exactly the limit the note states


def test_committed_stat_manifest_keeps_its_kind_and_hash():
    path = Path(__file__).resolve().parents[1] / "data_manifests" / "builtin-digits-feature-shift-10pc-seed0.json"
    doc = json.loads(path.read_text())
    m = load_manifest(path)  # checks the recorded content_hash
    assert m.content_hash == doc["content_hash"] and m.fingerprint_kind == "stat"
    # its fingerprints are content (the pixels' sha256), so the stat note does not apply
    assert not any(re.fullmatch(r"\d+:\d+", s.fingerprint) for s in m.all_samples())


def test_partition_help_names_sha256_as_the_default():
    out = CliRunner().invoke(main, ["partition", "--help"]).output
    assert "[default: sha256]" in " ".join(out.split()) and "cp -p" in out
