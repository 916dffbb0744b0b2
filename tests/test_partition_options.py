"""`embedcache partition` options: every option is honoured or refused (never ignored), the
output format follows --out, and clients left without test samples are said at partition time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from test_partition import _folder

from embedcache.cli import main
from embedcache.errors import UserError
from embedcache.manifest import load_manifest, manifest_from_dict, save_manifest
from embedcache.partitioning import Recipe, partition
from embedcache.sources import open_source


def _run(*args: str):
    return CliRunner().invoke(main, ["partition", *args])


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("imgs"))


@pytest.mark.parametrize("args, flag", [
    (["--scheme", "feature-shift", "--clients", "3"], "--clients"),
    (["--scheme", "feature-shift", "--alpha", "0.5"], "--alpha"),
    (["--scheme", "feature-shift", "--train-fraction", "0.2", "--train-per-class", "3"],
     "--train-per-class and --train-fraction"),
    (["--scheme", "feature-shift", "--min-samples", "3"], "--min-samples"),
    (["--scheme", "label-shift", "--train-per-class", "5"], "--train-per-class"),
    (["--scheme", "label-shift", "--test-per-class", "2"], "--test-per-class"),
    (["--scheme", "feature-label-shift", "--train-fraction", "0.2"], "--train-fraction"),
    (["--scheme", "feature-label-shift", "--min-samples", "1"], "--min-samples"),
    (["--preset", "fedncm", "--train-per-class", "5"], "--train-per-class"),
    (["--scheme", "label-shift", "--domain", "a", "--domains", "a,b"], "--domain and --domains"),
    (["--preset", "fedncm", "--scheme", "feature-shift"], "--scheme feature-shift: --preset fedncm is label-shift"),
])
def test_options_a_scheme_would_ignore_are_refused(root, tmp_path, args, flag):
    out = tmp_path / "m.json"
    res = _run(f"imagefolder:{root}", *args, "--out", str(out))
    assert res.exit_code == 2 and res.output.count("\n") == 1 and res.output.startswith(f"error: {flag}"), res.output
    assert not out.exists()


def test_clients_with_feature_shift_says_what_to_do_instead(root, tmp_path):
    res = _run(f"imagefolder:{root}", "--scheme", "feature-shift", "--clients", "3", "--out", str(tmp_path / "m.json"))
    assert "feature-shift makes one client per domain; choose domains with --domains" in res.output


def test_recipe_records_what_applied(root):
    src = open_source(f"imagefolder:{root}")
    fs = partition(src, Recipe("feature-shift"), seed=0).recipe
    assert fs["train_per_class"] == 10 and fs["alpha"] is None and fs["clients"] is None and fs["min_samples"] is None
    ls = partition(src, Recipe("label-shift", alpha=0.5), seed=0).recipe
    assert (ls["clients"], ls["alpha"], ls["train_fraction"], ls["train_per_class"]) == (5, 0.5, 0.1, None)
    assert partition(src, Recipe("feature-label-shift"), seed=0).recipe["clients"] == 2
    with pytest.raises(UserError, match="--alpha: not used by feature-shift"):
        partition(src, Recipe("feature-shift", alpha=1.0), seed=0)
    with pytest.raises(UserError, match="--fingerprint 'md5'"):
        partition(src, Recipe("feature-shift", fingerprint="md5"), seed=0)


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_out_is_yaml_with_the_same_content(root, tmp_path, suffix):
    args = [f"imagefolder:{root}", "--scheme", "feature-shift", "--train-per-class", "4", "--seed", "2"]
    assert _run(*args, "--out", str(tmp_path / "m.json")).exit_code == 0
    res = _run(*args, "--out", str(tmp_path / f"m{suffix}"))
    assert res.exit_code == 0, res.output
    text = (tmp_path / f"m{suffix}").read_text()
    assert not text.lstrip().startswith("{")
    assert yaml.safe_load(text) == json.loads((tmp_path / "m.json").read_text())  # same keys and values
    back = load_manifest(tmp_path / f"m{suffix}")
    assert back == load_manifest(tmp_path / "m.json")
    assert _run(*args, "--out", str(tmp_path / f"again{suffix}")).exit_code == 0
    assert (tmp_path / f"again{suffix}").read_bytes() == text.encode()


def test_other_out_suffixes_are_refused(root, tmp_path):
    for name in ("m.txt", "m"):
        res = _run(f"imagefolder:{root}", "--scheme", "feature-shift", "--out", str(tmp_path / name))
        assert res.exit_code == 2 and "must end in .json, .yaml or .yml" in res.output, res.output
        assert not (tmp_path / name).exists()
    m = partition(open_source(f"imagefolder:{root}"), Recipe("feature-shift"), seed=0)
    with pytest.raises(UserError, match="manifest files end in .json, .yaml or .yml"):
        save_manifest(m, tmp_path / "m.csv")


def _warnings(res) -> list[str]:
    return [ln for ln in res.output.splitlines() if ln.startswith("warning:")]


def test_clients_without_test_are_named_one_line_each(tmp_path):
    root = _folder(tmp_path / "a", domains=("big",), per_class=12)
    _folder(tmp_path / "a", domains=("small",), per_class=5)
    out = tmp_path / "m.json"
    res = _run(f"imagefolder:{root}", "--scheme", "feature-shift", "--train-per-class", "6", "--out", str(out))
    assert res.exit_code == 0, res.output
    lines = _warnings(res)
    assert [ln for ln in lines if "0 test samples" in ln] == [
        "warning: client c01-small has 0 test samples: it will have no accuracy (listed in report.clients_without_test)"]
    assert any("class(es) have fewer images than asked" in ln for ln in lines)
    assert load_manifest(out).report["clients_without_test"] == ["c01-small"]


def test_train_per_class_beyond_every_class_warns_loudly_but_writes(root, tmp_path):
    out = tmp_path / "m.json"
    res = _run(f"imagefolder:{root}", "--scheme", "feature-shift", "--train-per-class", "100", "--out", str(out))
    assert res.exit_code == 0, res.output
    lines = _warnings(res)
    assert sum("fewer images than asked" in ln for ln in lines) == 1  # one summary line, not one per class
    assert any("NO client has a test sample" in ln for ln in lines)
    m = load_manifest(out)
    assert len(m.report["short_classes"]) == 6 and m.report["clients_without_test"] == ["c00-a", "c01-b"]


def test_many_clients_without_test_are_capped(root, tmp_path):
    out = tmp_path / "m.json"
    res = _run(f"imagefolder:{root}", "--scheme", "label-shift", "--clients", "60", "--alpha", "0.5",
               "--min-samples", "0", "--out", str(out))
    assert res.exit_code == 0, res.output
    empty = load_manifest(out).report["clients_without_test"]
    assert len(empty) > 10
    per_client = [ln for ln in _warnings(res) if ln.startswith("warning: client ")]
    assert len(per_client) == 10 and all(name in "".join(per_client) for name in empty[:10])
    assert f"... and {len(empty) - 10} more clients with 0 test samples" in res.output


def test_case_colliding_client_names_are_refused_naming_both(tmp_path):
    doc = {"source": "x", "classes": ["a"], "clients": [
        {"name": "c0-Amazon", "domain": "amazon", "train": [["s1", "s1", 0]], "test": []},
        {"name": "c0-amazon", "domain": "amazon", "train": [["s2", "s2", 0]], "test": []}]}
    (tmp_path / "m.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match="client names 'c0-Amazon' and 'c0-amazon' differ only in case"):
        load_manifest(tmp_path / "m.json")
    with pytest.raises(UserError, match="c0-Amazon"):
        manifest_from_dict(doc)


def test_domain_names_become_safe_client_names(tmp_path):
    root = _folder(tmp_path / "d", domains=("my domain", "b"))
    m = partition(open_source(f"imagefolder:{root}"), Recipe("feature-shift", train_per_class=2), seed=0)
    assert [(c.name, c.domain) for c in m.clients] == [("c00-b", "b"), ("c01-my_domain", "my domain")]
