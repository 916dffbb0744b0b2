"""Manifests, sources and partitioners: exact counts, reproducible bytes, reported edge cases,
one-line errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from embedcache.cli import main
from embedcache.errors import UserError
from embedcache.manifest import Client, Manifest, Sample, load_manifest, save_manifest
from embedcache.partitioning import Recipe, dirichlet_split, partition
from embedcache.sources import open_source


def _folder(root: Path, domains=("a", "b"), classes=("cat", "dog", "emu"), per_class=12, corrupt=False) -> Path:
    rng = np.random.default_rng(0)
    for d in domains:
        for c in classes:
            (root / d / c).mkdir(parents=True, exist_ok=True)
            n = per_class - (3 if (d == "b" and c == "emu") else 0)  # b has fewer emus
            for k in range(n):
                Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / d / c / f"{k:02d}.png")
    if corrupt:
        (root / "a" / "cat" / "zz_bad.jpg").write_bytes(b"not a jpeg")
    return root


def test_imagefolder_index_and_errors(tmp_path):
    src = open_source(f"imagefolder:{_folder(tmp_path, corrupt=True)}")
    assert src.domains() == ["a", "b"] and src.classes() == ["cat", "dog", "emu"]
    idx = src.index()
    assert len(idx) == 12 * 6 - 3 + 1 and idx == sorted(idx, key=lambda r: (r[0], r[1]))
    assert src.load("a/dog/00.png").mode == "RGB"
    with pytest.raises(UserError, match="zz_bad.jpg"):
        src.load("a/cat/zz_bad.jpg")
    with pytest.raises(UserError, match="missing"):
        src.load("a/cat/nope.png")
    with pytest.raises(UserError, match="unknown"):
        open_source("ftp:whatever")


def test_feature_shift_counts_and_bytes(tmp_path):
    src = open_source(f"imagefolder:{_folder(tmp_path)}")
    m = partition(src, Recipe("feature-shift", train_per_class=10), seed=0)
    assert [c.name for c in m.clients] == ["c00-a", "c01-b"]
    a, b = m.clients
    assert Counter(s.label for s in a.train) == {0: 10, 1: 10, 2: 10}
    assert Counter(s.label for s in a.test) == {0: 2, 1: 2, 2: 2}
    assert Counter(s.label for s in b.train)[2] == 9 and "short_classes" in m.report  # 9 emus only
    assert not {s.id for s in a.train} & {s.id for s in a.test}
    save_manifest(m, tmp_path / "m1.json")
    save_manifest(partition(src, Recipe("feature-shift", train_per_class=10), seed=0), tmp_path / "m2.json")
    assert (tmp_path / "m1.json").read_bytes() == (tmp_path / "m2.json").read_bytes()
    other = partition(src, Recipe("feature-shift", train_per_class=10), seed=1)
    assert other.content_hash != m.content_hash
    back = load_manifest(tmp_path / "m1.json")
    assert back == m and back.content_hash == m.content_hash
    assert back.sample_list_hash("c00-a", "train") != back.sample_list_hash("c00-a", "test")


def test_dirichlet_split_is_a_partition():
    by_class = {k: [f"x{k}_{i}" for i in range(50)] for k in range(4)}
    parts = dirichlet_split(by_class, 5, 0.5, np.random.default_rng(0), 2, {})
    flat = [loc for p in parts for loc, _ in p]
    assert sorted(flat) == sorted(loc for v in by_class.values() for loc in v)
    # small alpha concentrates each class on few clients
    skew = dirichlet_split(by_class, 5, 0.05, np.random.default_rng(0), 0, {})
    top = [max(Counter(lab for _, lab in p).values(), default=0) / max(len(p), 1) for p in skew if p]
    assert np.mean(top) > 0.7


def test_label_shift_and_edge_cases(tmp_path):
    src = open_source(f"imagefolder:{_folder(tmp_path)}")
    m = partition(src, Recipe("label-shift", clients=3, alpha=0.3, domains=("a",), train_fraction=0.5), seed=3)
    assert {c.domain for c in m.clients} == {"a"}
    assert sum(len(c.train) + len(c.test) for c in m.clients) == 36
    # an alpha/clients combination that cannot be met is reported, not crashed on
    bad = partition(src, Recipe("label-shift", clients=60, alpha=0.01, train_fraction=0.5), seed=0)
    assert any("cannot be satisfied" in w for w in bad.report["warnings"])
    assert all(c.train for c in bad.clients) and "missing_classes" in bad.report
    with pytest.raises(UserError, match="domain 'zz'"):
        partition(src, Recipe("label-shift", domains=("zz",)), seed=0)


def test_feature_label_shift(tmp_path):
    src = open_source(f"imagefolder:{_folder(tmp_path, per_class=30)}")
    m = partition(src, Recipe("feature-label-shift", train_per_class=5, alpha=0.5), seed=0)
    assert [c.domain for c in m.clients] == ["a", "b"]
    for c in m.clients:
        assert 0 < len(c.train) <= 15
        assert {s.label for s in c.test} <= {s.label for s in c.train}
        assert not {s.id for s in c.train} & {s.id for s in c.test}


def test_manifest_rejects_bad_input(tmp_path):
    good = Manifest("x", ("a", "b"), (Client("c0", "d", (Sample("s1", "s1", 0),), ()),))
    save_manifest(good, tmp_path / "g.json")
    d = json.loads((tmp_path / "g.json").read_text())
    d["clients"][0]["train"][0][2] = 1  # a valid edit, but the hash no longer matches
    (tmp_path / "b.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match="content_hash"):
        load_manifest(tmp_path / "b.json")
    del d["content_hash"]
    d["clients"][0]["train"][0][2] = 7
    (tmp_path / "b.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match="s1.*label 7"):
        load_manifest(tmp_path / "b.json")
    (tmp_path / "j.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_manifest(tmp_path / "j.json")
    with pytest.raises(UserError, match="not found"):
        load_manifest(tmp_path / "none.json")
    with pytest.raises(UserError, match="client name"):
        Manifest("x", ("a",), (Client("bad/name", "d", (), ()),)).validate()


def test_builtin_digits_source():
    src = open_source("builtin:digits")
    assert len(src.domains()) >= 4 and src.classes() == [str(i) for i in range(10)]
    img = src.load("mnistm/0")
    assert img.size == (32, 32) and img.mode == "RGB"
    a = np.asarray(src.load("synth/5"))
    assert np.array_equal(a, np.asarray(open_source("builtin:digits").load("synth/5")))
    with pytest.raises(UserError, match="synth/99999"):
        src.load("synth/99999")


def test_jda_digits(shared):
    src = open_source(f"jda-digits:{shared / 'data' / 'digits_mnist_usps' / 'MNIST_vs_USPS.mat'}")
    idx = src.index()
    assert Counter(d for d, _, _ in idx) == {"mnist": 2000, "usps": 1800}
    assert src.load("usps/0").size == (16, 16)


def test_cli_partition_and_errors(tmp_path):
    root = _folder(tmp_path / "data")
    out = tmp_path / "m.json"
    r = CliRunner().invoke(main, ["partition", f"imagefolder:{root}", "--scheme", "feature-shift",
                                  "--train-per-class", "5", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert len(load_manifest(out).clients) == 2
    r = CliRunner().invoke(main, ["partition", f"imagefolder:{tmp_path / 'nope'}", "--scheme", "feature-shift",
                                  "--out", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0 and "nope" in r.output
    assert not (tmp_path / "x.json").exists()
