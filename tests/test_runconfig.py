"""Config files: `--dump-config` prints every option and the algorithm's whole config, `--config`
reads it back (the same run), flags beat the file, the file beats defaults, and a bad file is one
`error:` line. RUN_DIR/config.yaml is that file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from store_doubles import assert_one_line
from test_fedheads_cli import _write_store

from fedheads.algorithms import create_algorithm, list_algorithms
from fedheads.cli import main
from fedheads.run.commands import Compare, Train
from fedheads.run.options import walk
from fedheads.run.settings import resolved_settings


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _write_store(tmp_path_factory.mktemp("rc"))


def _cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def _base(store: Path, out: Path) -> list[str]:
    return ["train", "--store", store, "--backbones", "synth", "--algorithm", "fedpcl", "--rounds", "2",
            "--seeds", "0,1", "--device", "cpu", "--quiet", "--out", out]


@pytest.mark.parametrize("name", [i.name for i in list_algorithms()])
def test_resolved_settings_build_the_same_config(name):
    alg = create_algorithm(name)
    back = yaml.safe_load(yaml.safe_dump(resolved_settings(name, alg)))
    assert create_algorithm(name, **back).__dict__.get("cfg") == alg.__dict__.get("cfg")


@pytest.mark.parametrize("command", ["train", "compare"])
def test_the_dump_has_every_option_of_the_command(store, tmp_path, command):
    args = _base(store, tmp_path / "x") if command == "train" else \
        ["compare", "--store", store, "--backbones", "synth", "--algorithms", "lp,fedncm", "--out", tmp_path / "x"]
    res = _cli(*args, "--dump-config")
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(res.output)
    declared = Train if command == "train" else Compare
    options = {o.file_key for o in walk(declared) if o.meta.get("cli", True) and not o.meta.get("operational")}
    assert set(doc) - {"command"} == options  # nothing missing, nothing the command would refuse
    assert doc["command"] == command and not (tmp_path / "x").exists()
    if command == "compare":
        assert doc["set"]["lp.lr"] == create_algorithm("lp").cfg.optimizer.lr and "fedncm.lr" not in doc["set"]


def test_dump_then_config_reproduces_the_run_and_the_run_keeps_it(store, tmp_path):
    res = _cli(*_base(store, tmp_path / "a"), "--set", "tau=0.3", "--dump-config")
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(res.output)
    assert doc["seeds"] == [0, 1] and doc["set"]["tau"] == 0.3 and doc["set"]["variant"] == "paper"
    (tmp_path / "run.yaml").write_text(res.output)
    assert _cli(*_base(store, tmp_path / "a"), "--set", "tau=0.3").exit_code == 0
    res = _cli("train", "--config", tmp_path / "run.yaml", "--out", tmp_path / "b")
    assert res.exit_code == 0, res.output
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert a["history"] == b["history"] and a["per_client"] == b["per_client"] and b["seeds"] == [0, 1]
    kept = yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())
    assert kept == {**doc, "out": str(tmp_path / "a")}
    assert yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["out"] == str(tmp_path / "b")


def test_flags_beat_the_file_and_the_file_beats_defaults(store, tmp_path):
    (tmp_path / "f.yaml").write_text(yaml.safe_dump({
        "store": str(store), "backbones": ["synth"], "algorithm": "fedpcl", "rounds": 3, "seeds": 0,
        "out": str(tmp_path / "unused"), "set": {"tau": 0.3, "hidden": 64}}))
    res = _cli("train", "--config", tmp_path / "f.yaml", "--rounds", "2", "--set", "tau=0.7", "--lr", "0.01",
               "--out", tmp_path / "o", "--dump-config")
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(res.output)
    assert doc["rounds"] == 2 and doc["seeds"] == [0] and doc["out"] == str(tmp_path / "o")
    assert doc["set"]["tau"] == 0.7 and doc["set"]["hidden"] == 64 and doc["set"]["lr"] == 0.01
    assert doc["engine"] == "vectorized"  # not in the file: the default


def test_a_bad_file_is_one_line(store, tmp_path):
    f = tmp_path / "f.yaml"
    f.write_text("algorithm: fedpcl\nrund: 3\n")
    assert_one_line(_cli("train", "--config", f), 2, "unknown key 'rund' for `fedheads train`", "rounds",
                    "eval_every", "set")
    f.write_text("rounds: three\n")
    assert_one_line(_cli("train", "--config", f), 2, "f.yaml: rounds='three': expected an integer")
    f.write_text("binarize: 1\n")
    assert_one_line(_cli("train", "--config", f), 2, "binarize=1: expected true or false")
    f.write_text("engine: fast\n")
    assert_one_line(_cli("train", "--config", f), 2, "engine='fast': expected one of vectorized | loop")
    f.write_text("command: compare\n")
    assert_one_line(_cli("train", "--config", f), 2, "written for `fedheads compare`, not `fedheads train`")
    f.write_text("rounds: [1\n")
    assert_one_line(_cli("train", "--config", f), 2, "not valid YAML at line")
    f.write_text("set: {nope: 1}\n")
    assert_one_line(_cli(*_base(store, tmp_path / "z"), "--config", f), 2, "--set nope: not a setting of fedpcl")
    assert_one_line(_cli("train", "--config", tmp_path / "missing.yaml"), 2, "missing.yaml: cannot read")


@pytest.mark.parametrize("args", [
    ["finetune", "--manifest", "m.json", "--store", "s.zarr", "--backbone", "resnet20-cifar10", "--head", "fedncm,lp",
     "--rounds", "3", "--out", "o"],
    ["feddra", "--manifest", "m.json", "--image-encoder", "a", "--text-encoder", "b", "--preset", "quick",
     "--baseline", "feddra,fedavg", "--out", "o"],
])
def test_live_commands_read_back_what_they_dump(tmp_path, args):
    first = _cli(*args, "--dump-config")
    assert first.exit_code == 0, first.output
    (tmp_path / "f.yaml").write_text(first.output)
    again = _cli(args[0], "--config", tmp_path / "f.yaml", "--dump-config")
    assert again.exit_code == 0 and again.output == first.output
    doc = yaml.safe_load(first.output)
    if args[0] == "feddra":  # the preset's values, resolved: the file means the same under any preset
        assert doc["rounds"] == 4 and doc["set"]["steps"] == 5 and doc["baseline"] == ["feddra", "fedavg"]
        assert doc["set"]["text_trainable"] == "frozen" and doc["set"]["rho"] == 0.1  # every setting, with its value
    else:
        assert doc["head"] == ["fedncm", "lp"] and doc["rounds"] == 3 and doc["seeds"] == [0]
        assert doc["set"]["server"] == "fedavg" and doc["set"]["lr"] == 0.1 and doc["set"]["pretrained"] is True
