"""Bad input that used to get through manifests and imports: duplicate keys in hand-edited
JSON/YAML, locators outside the source, labels that are not integers, client names that cannot
be directories, complex features, and features of two models under one backbone name."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import store_doubles as d
import yaml
from click.testing import CliRunner
from store_doubles import assert_one_line

from embedcache.cli import main as ec
from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.manifest import Client, load_manifest, manifest_to_json, save_manifest
from embedcache.parsing import loads_json, loads_yaml
from embedcache.store import importer as store_import
from embedcache.store.importer import import_features
from embedcache.store.reader import identity_conflict, load_split, open_store


@pytest.fixture
def images(tmp_path) -> Path:
    return d.make_imagefolder(tmp_path / "imgs", per_class=3)


def _body(images: Path) -> dict:
    """A manifest's JSON body without its content_hash (as a hand edit leaves it)."""
    body = json.loads(manifest_to_json(d.make_manifest(images)))
    del body["content_hash"]
    return body


def _extract(images: Path, store: Path, m, backbones=("tiny",)):
    cfg = ExtractConfig(backbones=backbones, store=str(store), progress=False, num_workers=1, batch_size=2)
    return extract(m, cfg, source=d.FolderSource(str(images)), backbone_factory=d.tiny_factory)


# duplicate keys ------------------------------------------------------------------------------------------


def test_a_key_given_twice_in_a_json_manifest_is_refused_naming_key_and_file(images, tmp_path):
    body = _body(images)
    text = json.dumps(body, indent=1)
    # a second "classes" with two names swapped: json.loads keeps the last one silently
    swapped = json.dumps([body["classes"][1], body["classes"][0], *body["classes"][2:]])
    edited = text.replace('"classes":', f'"classes": {swapped},\n "classes":', 1)
    f = tmp_path / "m.json"
    f.write_text(edited)
    with pytest.raises(UserError, match=r"m\.json: key 'classes' appears twice"):
        load_manifest(f)


def test_a_key_given_twice_in_a_yaml_manifest_is_refused_with_its_line(images, tmp_path):
    body = _body(images)
    f = tmp_path / "m.yaml"
    text = yaml.safe_dump(body, sort_keys=True)
    # the second client's train list given twice (the last would silently drop the first's samples)
    edited = text.replace("  train:\n", "  train: []\n  train:\n", 1)
    f.write_text(edited)
    assert yaml.safe_load(edited)  # plain PyYAML accepts it
    with pytest.raises(UserError, match=r"m\.yaml: key 'train' appears twice in one mapping \(line \d+\)"):
        load_manifest(f)


def test_the_strict_parsers_keep_what_is_not_a_duplicate():
    assert loads_json('{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}', "x") == {"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}
    assert loads_yaml("base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  x: 3\n", "x") == {
        "base": {"x": 1, "y": 2}, "use": {"x": 3, "y": 2}}  # merge keys may be overridden
    with pytest.raises(UserError, match="x: key 'k' appears twice"):
        loads_json('{"k": 1, "k": 2}', "x")


def test_a_run_config_with_a_key_twice_is_one_line(tmp_path):
    from fedheads.cli import main as fh

    f = tmp_path / "c.yaml"
    f.write_text("rounds: 3\nalgorithm: fedpcl\nrounds: 30\n")
    assert_one_line(CliRunner().invoke(fh, ["train", "--config", str(f)]), 2, "c.yaml", "'rounds' appears twice")


def test_a_set_value_with_a_key_twice_is_refused():
    from fedheads.run.settings import parse_settings

    assert parse_settings(['w={"a": 1}', "x=word"]) == (("w", {"a": 1}), ("x", "word"))
    with pytest.raises(UserError, match="--set w: key 'a' appears twice"):
        parse_settings(['w={"a": 1, "a": 2}'])


def test_an_export_index_with_a_key_twice_is_refused(tmp_path):
    from embedcache.store.export import EXPORT_INDEX

    (tmp_path / "e").mkdir()
    (tmp_path / "e" / EXPORT_INDEX).write_text('{"format": "embedcache-export/1", "classes": ["a"], '
                                               '"classes": ["b"], "shards": {}}')
    assert_one_line(CliRunner().invoke(ec, ["import", "--store", str(tmp_path / "s"), str(tmp_path / "e")]), 2,
                    "export.json", "'classes' appears twice")


# locators and labels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("locator", ["/etc/hostname", "a/../../outside.png", "../x.png"])
def test_a_locator_outside_the_source_is_refused_naming_the_sample(images, tmp_path, locator):
    body = _body(images)
    body["clients"][0]["train"][0][1] = locator
    sid = body["clients"][0]["train"][0][0]
    (tmp_path / "m.json").write_text(json.dumps(body))
    with pytest.raises(UserError, match=f"sample {sid} .* has locator '{locator}', which points outside the source"):
        load_manifest(tmp_path / "m.json")


def test_the_image_folder_refuses_an_absolute_locator_like_a_dotdot_one(images, tmp_path):
    from embedcache.sources import open_source

    outside = tmp_path / "secret.png"
    outside.write_bytes((images / "a" / "cat" / "img_0.png").read_bytes())
    src = open_source(f"imagefolder:{images}")
    for loc in (str(outside), "../secret.png"):
        for call in (lambda loc=loc: src.load(loc), lambda loc=loc: src.fingerprint(loc),
                     lambda loc=loc: src.fingerprint(loc, "sha256")):
            with pytest.raises(UserError, match="locator escapes"):
                call()


@pytest.mark.parametrize("label", [1.9, True, "1", 1.0, None])
def test_a_label_that_is_not_an_integer_is_refused_naming_the_sample(images, tmp_path, label):
    body = _body(images)
    sid = body["clients"][0]["train"][0][0]
    body["clients"][0]["train"][0][2] = label
    (tmp_path / "m.json").write_text(json.dumps(body))
    with pytest.raises(UserError, match=f"sample '{sid}' has label .*; labels are integer class indices"):
        load_manifest(tmp_path / "m.json")
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(UserError, match="labels are integer class indices"):
        load_manifest(tmp_path / "m.yaml")


# client and domain names --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [".", "..", ".hidden", "c0.", "CON", "nul", "Com1", "LPT9.txt", "a b", ""])
def test_a_client_name_that_cannot_be_a_directory_everywhere_is_refused(images, tmp_path, name):
    body = _body(images)
    body["clients"][0]["name"] = name
    (tmp_path / "m.json").write_text(json.dumps(body))
    with pytest.raises(UserError, match=f"client name {name!r}"):
        load_manifest(tmp_path / "m.json")


def test_names_that_are_fine_stay_fine(images, tmp_path):
    m = d.make_manifest(images)
    ok = [replace(c, name=n) for c, n in zip(m.clients, ("c.0-a_b", "CONSOLE"))]
    save_manifest(replace(m, clients=tuple(ok)), tmp_path / "m.json")
    assert [c.name for c in load_manifest(tmp_path / "m.json").clients] == ["c.0-a_b", "CONSOLE"]


def test_a_bad_client_name_is_refused_before_any_shard_is_written(images, tmp_path):
    m = d.make_manifest(images)  # built in Python: never validated
    bad = replace(m, clients=(m.clients[0], replace(m.clients[1], name="..")))
    store = tmp_path / "s"
    with pytest.raises(UserError, match=r"client name '\.\.'"):
        _extract(images, store, bad)
    assert not store.exists() or not any(p.is_dir() for p in store.iterdir())


@pytest.mark.parametrize("name", [".", "..", "CON"])
def test_import_refuses_such_a_client_name(tmp_path, name):
    np.savez(tmp_path / "f.npz", features=np.ones((3, 2), np.float32), labels=np.array([0, 1, 0]))
    res = CliRunner().invoke(ec, ["import", "--store", str(tmp_path / "s"), "--backbone", "b", "--client", name,
                                  "--split", "train", str(tmp_path / "f.npz")])
    assert_one_line(res, 2, f"client name {name!r}")
    assert not (tmp_path / "s").exists()


def test_a_domain_with_a_line_break_is_refused(images, tmp_path):
    body = _body(images)
    body["clients"][0]["domain"] = "a\nb"
    (tmp_path / "m.json").write_text(json.dumps(body))
    with pytest.raises(UserError, match="domain 'a\\\\nb' must be text without control characters"):
        load_manifest(tmp_path / "m.json")


# imports ------------------------------------------------------------------------------------------------


def test_complex_features_are_refused_not_cast(tmp_path):
    x = (np.ones((4, 3)) + 1j * np.arange(12).reshape(4, 3)).astype(np.complex64)
    np.savez(tmp_path / "f.npz", features=x, labels=np.array([0, 1, 0, 1]))
    res = CliRunner().invoke(ec, ["import", "--store", str(tmp_path / "s"), "--backbone", "b", "--client", "c0",
                                  "--split", "train", str(tmp_path / "f.npz")])
    assert_one_line(res, 2, "f.npz: features are complex (complex64)")
    assert not (tmp_path / "s").exists()


@pytest.fixture
def extracted(images, tmp_path) -> Path:
    store = tmp_path / "s"
    _extract(images, store, d.make_manifest(images))
    return store


def _other_model(tmp_path: Path, n: int = 4) -> Path:
    np.savez(tmp_path / "other.npz", features=np.full((n, 4), 3.0, np.float32), labels=np.arange(n) % 3)
    return tmp_path / "other.npz"


def test_features_of_another_model_under_an_extracted_backbones_name_are_refused(extracted, tmp_path):
    f = _other_model(tmp_path)
    before = sorted(p.relative_to(extracted) for p in extracted.rglob("*"))
    res = CliRunner().invoke(ec, ["import", "--store", str(extracted), "--backbone", "tiny", "--client", "c-new",
                                  "--split", "train", str(f)])
    assert_one_line(res, 2, "--backbone tiny: the store holds features extracted by that backbone", "weights ",
                    "file sha256 ", "another backbone name")
    assert sorted(p.relative_to(extracted) for p in extracted.rglob("*")) == before
    import_features(extracted, f, backbone="tiny-other", client="c-new", split="train")  # its own name is fine
    # replacing every extracted shard of a name is not mixing: only the shards that stay count
    info = open_store(extracted)
    assert {s.backbone for s in info.shards} == {"tiny", "tiny-other"}


def test_extracting_under_a_name_that_holds_imported_features_is_refused(images, tmp_path):
    store = tmp_path / "s"
    m = d.make_manifest(images)
    import_features(store, _other_model(tmp_path), backbone="tiny", client="c-z", split="train",
                    classes=list(m.classes))
    with pytest.raises(UserError, match=r"tiny: the store holds imported features under this name \(e.g. "
                                        r"tiny/c-z/train, from other.npz\)"):
        _extract(images, store, m)
    assert {s.backbone for s in open_store(store).shards} == {"tiny"} and len(open_store(store).shards) == 1


def test_training_on_two_models_under_one_name_is_one_line(extracted, tmp_path, monkeypatch):
    from fedheads.run.load import load_fed_data

    # a store written before imports were refused: one client's tiny features come from another model
    f = _other_model(tmp_path, 6)
    monkeypatch.setattr(store_import, "_extracted_beside", lambda store, specs: None)
    import_features(extracted, f, backbone="tiny", client="c-b", split="train")
    monkeypatch.undo()
    msg = r"backbone tiny: shards tiny/c-a/\w+ \(weights \w{12}\) and tiny/c-b/train \(weights \w{12}\) hold " \
          r"features of different models or preprocessing \(one extracted, one imported\)"
    with pytest.raises(UserError, match=msg):
        load_fed_data(str(extracted), ["tiny"], device="cpu")
    with pytest.raises(UserError, match=msg):
        load_split(extracted, ["tiny"], "train")
    load_split(extracted, ["tiny"], "test")  # the test splits are all extracted: fine
    load_fed_data(str(extracted), ["tiny"], device="cpu", clients=["c-a"])  # one model within the selection


def test_identity_conflict_is_the_flower_servers_rule():
    from fedheads.flower.server import _same_backbones

    ext = {"preprocess": {"resize": [8, 8]}}
    imp1, imp2 = {"preprocess": {"imported_from": "a.npz"}}, {"preprocess": {"imported_from": "b.npz"}}
    assert identity_conflict([("n0", "w1", ext["preprocess"]), ("n1", "w1", ext["preprocess"])]) is None
    assert identity_conflict([("n0", "fa", imp1["preprocess"]), ("n1", "fb", imp2["preprocess"])]) is None
    assert identity_conflict([("n0", "w1", ext["preprocess"]), ("n1", "w2", ext["preprocess"])]) == ("n0", "n1")
    assert identity_conflict([("n0", "w1", ext["preprocess"]), ("n1", "fa", imp1["preprocess"])]) == ("n0", "n1")

    def desc(client, w, pre):
        return (0, {"client": client, "backbones": json.dumps({"b": {"dim": 4, "weights_sha256": w, "preprocess": pre}})})

    _same_backbones([desc("c0", "fa", imp1["preprocess"]), desc("c1", "fb", imp2["preprocess"])])
    with pytest.raises(UserError, match="flower: backbone b: nodes c0 and c1"):
        _same_backbones([desc("c0", "w1", ext["preprocess"]), desc("c1", "fa", imp1["preprocess"])])


def test_client_objects_stay_constructible(images):
    # the checks live in validate(), so building a Client in Python keeps working as before
    assert Client(".", "d", (), ()).name == "."
