"""`fedheads predict --manifest / --images`: new images extracted through the run's backbones
(cached, drift-checked), checked against the training features, classified by each sample's own
client or the global model (docs/contracts.md, 6c)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from store_doubles import TinyBackbone, assert_one_line, make_imagefolder, make_manifest

import embedcache
import fedheads
from embedcache.errors import UserError
from embedcache.manifest import save_manifest
from embedcache.sources.imagefolder import ImageFolder
from fedheads.cli import main


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _invoke(args: list[str]):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Images of 2 domains x 3 classes, their manifest, a store extracted with `tiny`, and a
    FedPCL (no global model) and an LP (global model) run on it."""
    root = tmp_path_factory.mktemp("pi")
    images = make_imagefolder(root / "img", per_class=9)
    manifest = root / "m.json"
    save_manifest(make_manifest(images), manifest)
    store = root / "train.zarr"
    embedcache.extract(manifest, "tiny", store, progress=False, num_workers=1, batch_size=4, chunk_rows=8)
    runs = {}
    for alg in ("fedpcl", "lp"):
        runs[alg] = root / alg
        r = _invoke(["train", "--store", store, "--backbones", "tiny", "--algorithm", alg, "--rounds", "3",
                     "--seeds", "0", "--quiet", "--out", runs[alg]])
        assert r.exit_code == 0, r.output
    return {"root": root, "images": images, "manifest": manifest, "store": store, "runs": runs}


@pytest.mark.parametrize("alg", ["fedpcl", "lp"])
def test_manifest_test_split_reproduces_trains_own_evaluation(trained, tmp_path, alg):
    """The acceptance check: re-extracted from the images into a fresh cache (with the training
    store's batch size and chunking, recorded in config.json), the training manifest's test split
    gives exactly the per-client accuracy `train` reported, and the predictions of the stored
    features row for row."""
    run = trained["runs"][alg]
    out = tmp_path / "p.csv"
    r = _invoke(["predict", "--run", run, "--manifest", trained["manifest"], "--top-k", "2", "--quiet", "--out", out])
    assert r.exit_code == 0, r.output
    res = json.loads((run / "results.json").read_text())
    rows = _rows(out)
    assert {r["client"] for r in rows} == set(res["clients"])
    for c, v in res["per_client"].items():
        mine = [r for r in rows if r["client"] == c]
        assert len(mine) == v["n_test"]
        assert 100.0 * np.mean([r["label"] == r["prediction"] for r in mine]) == pytest.approx(v["mean"], abs=1e-9)
        assert f"{c}: accuracy {v['mean']:.2f} %" in r.output
    assert (run / "predict-cache" / "zarr.json").is_file()  # the documented default cache
    stored = tmp_path / "s.csv"
    assert _invoke(["predict", "--run", run, "--store", trained["store"], "--top-k", "2", "--out", stored]).exit_code == 0
    key = lambda r: (r["client"], r["sample_id"])  # noqa: E731
    assert sorted(map(key, _rows(stored))) == sorted(map(key, rows))
    same = {key(r): (r["prediction"], r["top2_label"]) for r in _rows(stored)}
    assert all(same[key(r)] == (r["prediction"], r["top2_label"]) for r in rows)
    classes = ("cat", "dog", "emu")
    assert all(r["prediction_name"] == classes[int(r["prediction"])] and r["label_name"] == classes[int(r["label"])]
               for r in rows)


def test_multi_backbone_fedpcl_extracts_every_backbone(trained, tmp_path):
    """FedPCL on two backbones (features concatenated, FedPCL Eq. 1-2): both are re-extracted and
    checked; the test split again gives train's own per-client accuracy."""
    store = tmp_path / "two.zarr"
    embedcache.extract(trained["manifest"], "tiny,tiny2", store, progress=False, num_workers=1)
    run = tmp_path / "run"
    assert _invoke(["train", "--store", store, "--backbones", "tiny,tiny2", "--algorithm", "fedpcl", "--rounds", "2",
                    "--seeds", "0", "--quiet", "--out", run]).exit_code == 0
    r = _invoke(["predict", "--run", run, "--manifest", trained["manifest"], "--quiet", "--out", tmp_path / "p.csv"])
    assert r.exit_code == 0, r.output
    res = json.loads((run / "results.json").read_text())
    for c, v in res["per_client"].items():
        assert f"{c}: accuracy {v['mean']:.2f} %" in r.output
    info = embedcache.open_store(run / "predict-cache", quiet=True)
    assert sorted(info.backbones) == ["tiny", "tiny2"]


def test_manifest_in_the_training_store_is_a_cache_hit_that_changes_nothing(trained, tmp_path, monkeypatch):
    run = trained["runs"]["lp"]
    before = json.loads((trained["store"] / "zarr.json").read_text())["attributes"]
    monkeypatch.setattr(ImageFolder, "load", lambda self, loc: (_ for _ in ()).throw(AssertionError(loc)))
    r = _invoke(["predict", "--run", run, "--manifest", trained["manifest"], "--cache", trained["store"],
                 "--client", "c-a", "--out", tmp_path / "p.csv"])
    assert r.exit_code == 0, r.output
    assert {row["client"] for row in _rows(tmp_path / "p.csv")} == {"c-a"}
    after = json.loads((trained["store"] / "zarr.json").read_text())["attributes"]
    assert after["manifest_hash"] == before["manifest_hash"] and after["clients"] == before["clients"]


def _new_images(root: Path) -> Path:
    """cat/ and dog/ (class folders), misc/ (not a class) and one loose image."""
    src = make_imagefolder(root / "src", domains=("x",), per_class=3)
    new = root / "new"
    for c in ("cat", "dog"):
        (new / c).mkdir(parents=True)
        for f in (src / "x" / c).iterdir():
            (new / c / f.name).write_bytes(f.read_bytes())
    (new / "misc").mkdir()
    (new / "misc" / "a.png").write_bytes((src / "x" / "emu" / "img_0.png").read_bytes())
    (new / "loose.png").write_bytes((src / "x" / "emu" / "img_1.png").read_bytes())
    (new / "notes.txt").write_text("not an image")
    (new / ".hidden.png").write_bytes(b"skipped")
    return new


def test_images_by_the_global_model_with_names_and_capped_top_k(trained, tmp_path, monkeypatch):
    new = _new_images(tmp_path)
    run, out = trained["runs"]["lp"], tmp_path / "p.csv"
    r = _invoke(["predict", "--run", run, "--images", f"imagefolder:{new}", "--top-k", "7", "--quiet", "--out", out])
    assert r.exit_code == 0, r.output
    assert "note: --top-k 7 capped at the run's 3 classes" in r.output
    assert "note: --images: folders misc are not classes of the run" in r.output
    rows = _rows(out)
    assert sorted(r["sample_id"] for r in rows) == sorted(
        [f"cat/img_{k}.png" for k in range(3)] + [f"dog/img_{k}.png" for k in range(3)] + ["misc/a.png", "loose.png"])
    assert {r["client"] for r in rows} == {"(global)"}
    assert list(rows[0])[-3:] == ["top3_label", "top3_name", "top3_score"]
    by = {r["sample_id"]: r for r in rows}
    assert by["cat/img_0.png"]["label"] == "0" and by["cat/img_0.png"]["label_name"] == "cat"
    assert by["loose.png"]["label"] == "-1" and by["misc/a.png"]["label_name"] == ""
    assert all(r["prediction_name"] == ("cat", "dog", "emu")[int(r["prediction"])] for r in rows)
    labelled = [r for r in rows if r["label"] != "-1"]
    acc = 100.0 * np.mean([r["label"] == r["prediction"] for r in labelled])
    assert f"(global): accuracy {acc:.2f} % ({sum(r['label'] == r['prediction'] for r in labelled)}/6 labelled)" in r.output
    # the global model's predictions are those of the API on the same features
    table = fedheads.predict(run, images=f"imagefolder:{new}", top_k=3)
    assert sorted(zip(table["sample_id"], table["prediction"].astype(str))) == sorted(
        (r["sample_id"], r["prediction"]) for r in rows)

    # a re-run is a cache hit: no image is decoded
    loads = []
    real = ImageFolder.load
    monkeypatch.setattr(ImageFolder, "load", lambda self, loc: loads.append(loc) or real(self, loc))
    assert _invoke(["predict", "--run", run, "--images", f"imagefolder:{new}", "--out", out]).exit_code == 0
    assert loads == []
    # a changed image changes its fingerprint, hence its shard's key: that folder is re-extracted
    px = np.full((12, 12, 3), 255, np.uint8)
    Image.fromarray(px).save(new / "dog" / "img_1.png")
    assert _invoke(["predict", "--run", run, "--images", f"imagefolder:{new}", "--out", out]).exit_code == 0
    assert sorted(loads) == [f"dog/img_{k}.png" for k in range(3)]


def test_images_need_a_client_without_a_global_model(trained, tmp_path):
    new = _new_images(tmp_path)
    run, out = trained["runs"]["fedpcl"], tmp_path / "p.csv"
    assert_one_line(_invoke(["predict", "--run", run, "--images", f"imagefolder:{new}", "--cache", tmp_path / "c",
                             "--out", out]), 2, "error: fedpcl has no global model", "--client")
    assert not out.exists() and not (tmp_path / "c").exists()  # refused before extracting
    r = _invoke(["predict", "--run", run, "--images", f"imagefolder:{new}", "--client", "c-b", "--quiet", "--out", out])
    assert r.exit_code == 0, r.output
    assert {row["client"] for row in _rows(out)} == {"c-b"}
    r = _invoke(["predict", "--run", run, "--images", f"imagefolder:{new}", "--client", "all", "--quiet", "--out", out])
    assert r.exit_code == 0 and len(_rows(out)) == 2 * 8


@pytest.mark.parametrize("field,needle", [
    ("weights_sha256", "backbone tiny: weights (sha256) differs from the training run's"),
    ("preprocess", "backbone tiny: preprocessing differs from the training run's (resize"),
    ("dim", "backbone tiny: feature dimension differs from the training run's (5 -> 4)"),
])
def test_a_backbone_that_is_not_trainings_is_refused(trained, tmp_path, field, needle):
    """The run's config.json as a run trained with other weights / preprocessing would have it."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained["runs"]["lp"], run, ignore=shutil.ignore_patterns("predict-cache"))
    cfg = json.loads((run / "config.json").read_text())
    rec = cfg["store_fingerprint"]["backbones"]["tiny"]
    rec[field] = {"weights_sha256": "0" * 64, "preprocess": {**rec["preprocess"], "resize": [9, 9]}, "dim": 5}[field]
    (run / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "p.csv"
    for how in (["--images", f"imagefolder:{trained['images'] / 'a'}"], ["--manifest", trained["manifest"]]):
        assert_one_line(_invoke(["predict", "--run", run, *how, "--out", out]), 2, "error: " + needle)
    assert not out.exists() and not (run / "predict-cache").exists()


def test_a_backbone_whose_weights_changed_since_training_is_refused(trained, tmp_path):
    """The same name, other weights (a re-registered or updated backbone): refused, not used."""
    from store_doubles import tiny_factory

    from embedcache.backbones import register_backbone

    register_backbone("tiny", lambda wd, dev: TinyBackbone("tiny", seed=1), description="test double tiny")
    try:
        assert_one_line(_invoke(["predict", "--run", trained["runs"]["lp"], "--manifest", trained["manifest"],
                                 "--cache", tmp_path / "c", "--out", tmp_path / "p.csv"]), 2,
                        "error: backbone tiny: weights (sha256) differs")
    finally:
        register_backbone("tiny", lambda wd, dev: tiny_factory("tiny", None, dev), description="test double tiny")
    assert not (tmp_path / "p.csv").exists()


def test_bad_images_are_one_line_and_leave_no_output(trained, tmp_path):
    run, out = trained["runs"]["lp"], tmp_path / "p.csv"
    cache = ["--cache", tmp_path / "cache"]
    assert_one_line(_invoke(["predict", "--run", run, "--images", f"imagefolder:{tmp_path / 'nope'}", *cache,
                             "--out", out]), 2, "error:", "not found")
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    (tmp_path / "empty" / "cat" / "readme.txt").write_text("x")
    assert_one_line(_invoke(["predict", "--run", run, "--images", f"imagefolder:{tmp_path / 'empty'}", *cache,
                             "--out", out]), 2, "error: --images", "no image files")
    bad = _new_images(tmp_path)
    for f in (bad / "misc").iterdir():  # (its note would be a second line)
        f.unlink()
    (bad / "dog" / "img_2.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    assert_one_line(_invoke(["predict", "--run", run, "--images", f"imagefolder:{bad}", *cache, "--quiet",
                             "--out", out]), 2, "error:", "dog/img_2.png")
    assert_one_line(_invoke(["predict", "--run", run, "--images", "folder:x", "--out", out]), 2,
                    "error: --images folder:x: expected imagefolder:PATH")
    assert_one_line(_invoke(["predict", "--run", run, "--images", f"imagefolder:{bad}", "--store", trained["store"],
                             "--out", out]), 2, "error: --store / --manifest / --images: give exactly one")
    assert_one_line(_invoke(["predict", "--run", run, "--manifest", trained["manifest"], "--client", "c-zz",
                             "--out", out]), 2, "error: --client c-zz")
    # options that do not apply are refused, never ignored
    assert_one_line(_invoke(["predict", "--run", run, "--images", f"imagefolder:{bad}", "--split", "train",
                             "--out", out]), 2, "error: --split: not used with --images")
    assert_one_line(_invoke(["predict", "--run", run, "--store", trained["store"], *cache, "--batch-size", "8",
                             "--out", out]), 2, "error: --cache, --batch-size: not used with --store")
    assert not out.exists() and not list(tmp_path.glob(".p.csv*"))


def test_result_predict_on_features_and_on_a_run_directory(trained, tmp_path):
    train, test = (embedcache.load_split(trained["store"], "tiny", s) for s in ("train", "test"))
    arrays = {c: (train[c].features, train[c].labels, test[c].features, test[c].labels) for c in train}
    res = fedheads.train(arrays, "fedpcl", rounds=3, seeds=0)
    for c in arrays:
        t = res.predict(test[c].features, client=c, top_k=2)
        assert set(t["client"]) == {c} and t["top2_label"].shape == (len(test[c].labels),)
        assert 100.0 * np.mean(t["prediction"] == test[c].labels) == pytest.approx(res.per_client[c]["mean"])
    with pytest.raises(UserError, match="fedpcl has no global model"):
        res.predict(test["c-a"].features)
    with pytest.raises(UserError, match="dimension 3 != prototype dimension 4"):
        res.predict(test["c-a"].features[:, :3], client="c-a")
    lp = fedheads.train(trained["store"], "lp", backbones="tiny", rounds=3, seeds=0)
    t = lp.predict(test["c-b"].features)
    assert set(t["client"]) == {"(global)"} and set(t["prediction_name"]) <= {"cat", "dog", "emu"}
    disk = fedheads.train(trained["store"], "lp", backbones="tiny", rounds=3, seeds=0, out=tmp_path / "run")
    done = disk.predict(manifest=trained["manifest"], out=tmp_path / "p.parquet" if _has_arrow() else tmp_path / "p.csv")
    assert done.per_client["c-a"]["accuracy"] == pytest.approx(disk.per_client["c-a"]["mean"])
    assert np.array_equal(disk.predict(test["c-b"].features)["prediction"], t["prediction"])


def _has_arrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def test_images_in_the_partition_layout_are_labelled_by_their_class_folders(trained, tmp_path):
    """`<domain>/<class>/<image>` (the layout `embedcache partition` reads): each image's label is
    its class folder's, mapped through the run's class list, and the accuracy is reported."""
    run, out = trained["runs"]["lp"], tmp_path / "p.csv"
    r = _invoke(["predict", "--run", run, "--images", f"imagefolder:{trained['images']}", "--quiet", "--out", out])
    assert r.exit_code == 0, r.output
    rows = _rows(out)
    assert len(rows) == 2 * 3 * 9 and all(r["label"] != "-1" for r in rows)
    assert all(r["label_name"] == r["sample_id"].split("/")[1] for r in rows)
    correct = sum(r["label"] == r["prediction"] for r in rows)
    assert f"(global): accuracy {100.0 * correct / len(rows):.2f} % ({correct}/{len(rows)} labelled)" in r.output
    assert "note:" not in r.output


def test_partition_layout_with_a_class_the_run_lacks_is_one_line(trained, tmp_path):
    import shutil

    new = tmp_path / "new"
    shutil.copytree(trained["images"], new)
    (new / "b" / "zebra").mkdir()
    shutil.copy(new / "b" / "cat" / "img_0.png", new / "b" / "zebra" / "z.png")
    out = tmp_path / "p.csv"
    assert_one_line(_invoke(["predict", "--run", trained["runs"]["lp"], "--images", f"imagefolder:{new}",
                             "--cache", tmp_path / "c", "--out", out]), 2, "error: --images", "b/zebra",
                    "not a class of the run")
    assert not out.exists() and not (tmp_path / "c").exists()


def test_images_without_any_label_say_so_in_one_line(trained, tmp_path):
    """Loose images, or folders named like no class: predictions without accuracy, and one note
    naming the layouts that give labels (never a silent -1)."""
    src = trained["images"] / "a" / "cat"
    for layout in ("loose", "other"):
        new = tmp_path / layout
        where = new if layout == "loose" else new / "p" / "q"
        where.mkdir(parents=True)
        for f in list(src.iterdir())[:2]:
            (where / f.name).write_bytes(f.read_bytes())
        out = tmp_path / f"{layout}.csv"
        r = _invoke(["predict", "--run", trained["runs"]["lp"], "--images", f"imagefolder:{new}", "--quiet",
                     "--out", out])
        assert r.exit_code == 0, r.output
        notes = [ln for ln in r.output.splitlines() if ln.startswith("note:")]
        assert len(notes) == 1 and "no image has a label" in notes[0], r.output
        assert "<class>/<image>" in notes[0] and "<domain>/<class>/<image>" in notes[0]
        assert "accuracy" not in r.output.replace(notes[0], "")
        assert {row["label"] for row in _rows(out)} == {"-1"}


def test_partition_layout_images_outside_class_folders_are_noted(trained, tmp_path):
    import shutil

    new = tmp_path / "new"
    shutil.copytree(trained["images"] / "a", new / "a")
    shutil.copy(new / "a" / "cat" / "img_0.png", new / "a" / "stray.png")
    out = tmp_path / "p.csv"
    r = _invoke(["predict", "--run", trained["runs"]["lp"], "--images", f"imagefolder:{new}", "--quiet", "--out", out])
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.output.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "1 image outside <domain>/<class>/ folders" in notes[0] and "a/stray.png" in notes[0]
    by = {row["sample_id"]: row for row in _rows(out)}
    assert by["a/stray.png"]["label"] == "-1" and by["a/dog/img_3.png"]["label_name"] == "dog"
    assert "(global): accuracy" in r.output and "(27/27 labelled)" not in r.output and "/27 labelled)" in r.output
