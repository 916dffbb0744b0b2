"""The Python API (embedcache.api, fedheads.api): the README's example runs as written, the
functions mirror the commands, results match the CLI's, and nothing is written unless asked."""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest

import embedcache
import fedheads
from embedcache.errors import UserError
from fedheads.api import Result
from tests.backbone_doubles import TINY_RECIPE

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The first python block of the README's "Python API" section."""
    text = README.read_text()
    section = text[text.index("## Python API"):]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "README: the Python API section has no python block"
    return blocks[0]


@pytest.mark.slow  # pre-trains a tiny digitnet and extracts real digits: about a minute
def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    from embedcache.backbones import digitnet

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EMBEDCACHE_OFFLINE", "1")
    monkeypatch.setenv("EMBEDCACHE_CACHE", str(tmp_path / "cache"))
    for var in ("EMBEDCACHE_WEIGHTS", "EMBEDCACHE_ASSETS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(digitnet, "DEFAULT_RECIPE", TINY_RECIPE)  # a seconds-long pre-training
    code = readme_example()
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 10
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert re.match(r"\d+\.\d+ \(n=1\) \{'c00-mnist': ", out[0]), out[0]  # one seed: no spread
    compared = json.loads((tmp_path / "runs/api/results.json").read_text())
    assert set(compared["algorithms"]) == {"fedncm", "lp"}
    assert out[1] == str({n: r["accuracy_cell"] for n, r in compared["algorithms"].items()})
    assert not (tmp_path / "runs/fedncm").exists()  # train without out= wrote nothing


def test_top_level_names_are_the_api():
    assert fedheads.train is fedheads.api.train and fedheads.compare is fedheads.api.compare
    assert embedcache.open_store is embedcache.api.open_store
    # the modules that do the work have other names, so importing them replaces no API function
    importlib.import_module("embedcache.extraction")
    importlib.import_module("embedcache.partitioning")
    from fedheads.prediction.predict import run_predict  # noqa: F401

    assert embedcache.extract is embedcache.api.extract and embedcache.partition is embedcache.api.partition
    assert inspect.signature(fedheads.predict) == inspect.signature(fedheads.api.predict)
    for f in (fedheads.train, fedheads.compare, fedheads.api.predict, fedheads.finetune,
              embedcache.api.partition, embedcache.api.extract):
        assert f.__doc__ and all(p.annotation is not inspect.Parameter.empty
                                 for p in inspect.signature(f).parameters.values()), f.__name__


def _arrays(seed: int = 0, clients: int = 3, dim: int = 6, classes: int = 3):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * 3
    out = {}
    for i in range(clients):
        parts = []
        for n in (30, 15):
            y = rng.integers(0, classes, n)
            parts += [(centres[y] + rng.normal(size=(n, dim))).astype(np.float32), y]
        out[f"c{i}"] = tuple(parts)
    return out


def test_train_on_arrays_in_memory_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = fedheads.train(_arrays(), "fedncm", rounds=1, seeds=[0, 1])
    assert isinstance(res, Result) and res.run_dir is None and not list(tmp_path.iterdir())
    assert res.clients == ["c0", "c1", "c2"] and res.num_classes == 3 and res.feature_dim == 6
    assert res.accuracy["mean"] > 90 and res["accuracy"] == res.accuracy
    assert set(res.states) == {0} and json.loads(res.to_json())["algorithm"] == "fedncm"  # seed-free: run once
    assert "does not depend on the seed" in res["notes"][0]
    with pytest.raises(AttributeError, match="no field 'nope'"):
        _ = res.nope


def test_arrays_written_run_equals_in_memory(tmp_path):
    kw = dict(rounds=3, seeds=[0], settings={"lr": 0.05})
    mem = fedheads.train(_arrays(), "lp", **kw)
    disk = fedheads.train(_arrays(), "lp", out=tmp_path / "run", **kw)
    saved = json.loads((tmp_path / "run/results.json").read_text())
    assert disk.run_dir == tmp_path / "run" and saved["per_client"] == mem.per_client == disk.per_client
    assert json.loads((tmp_path / "run/config.json").read_text())["algorithm_kwargs"] == {"lr": 0.05}
    with pytest.raises(UserError, match="holds a lp run"):
        fedheads.train(_arrays(), "lp", out=tmp_path / "run", **kw)


def test_compare_on_arrays(tmp_path):
    cmp = fedheads.compare(_arrays(), "fedncm,lp", rounds=2, seeds=0, settings={"lp.lr": 0.05})
    assert set(cmp.algorithms) == {"fedncm", "lp"}
    assert isinstance(cmp.algorithms["lp"], Result) and cmp.algorithms["lp"].algorithm == "lp"
    assert json.loads(cmp.to_json())["algorithms"]["lp"]["rounds"] == 2


def test_bad_input_is_one_user_error():
    with pytest.raises(UserError, match="c0: expected"):
        fedheads.train({"c0": (np.zeros((2, 2)), np.zeros(2))}, "fedncm")
    with pytest.raises(UserError, match="backbones: needed"):
        fedheads.train("some.zarr", "fedncm")
    with pytest.raises(UserError, match="unknown"):
        fedheads.train(_arrays(), "no-such-algorithm", rounds=1, seeds=0)
    with pytest.raises(UserError, match="--out x.txt"):
        embedcache.partition("builtin:digits", scheme="feature-shift", out="x.txt")


def test_store_api_matches_the_cli(tmp_path):
    """train on a store without out= gives the CLI's results; predict returns the CLI's table."""
    from click.testing import CliRunner

    from fedheads.cli import main
    from tests.test_fedheads_cli import _write_store

    store = _write_store(tmp_path)
    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedproto",
                                  "--rounds", "2", "--seeds", "0", "--quiet", "--out", str(run)])
    assert r.exit_code == 0, r.output
    cli = json.loads((run / "results.json").read_text())
    mem = fedheads.train(store, "fedproto", backbones="synth", rounds=2, seeds=[0])
    assert mem.per_client == cli["per_client"] and mem.clients == cli["clients"]
    table = fedheads.predict(run, store, top_k=2)
    done = fedheads.predict(run, store, top_k=2, out=tmp_path / "p.csv")
    rows = (tmp_path / "p.csv").read_text().splitlines()
    assert done.rows == len(table["label"]) == len(rows) - 1 and rows[0].split(",") == list(table)
    assert {c: v["accuracy"] for c, v in done.per_client.items()} == pytest.approx(
        {c: v["mean"] for c, v in cli["per_client"].items()})
    acc = {c: 100.0 * float(np.mean(table["prediction"][table["client"] == c] == table["label"][table["client"] == c]))
           for c in cli["clients"]}
    assert acc == pytest.approx({c: v["mean"] for c, v in cli["per_client"].items()})
