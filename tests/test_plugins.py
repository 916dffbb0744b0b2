"""`fedheads --plugin MODULE` / `$FEDHEADS_PLUGINS`: an algorithm registered from user code
(docs/custom_algorithm.md's ridge head, saved as a module in tmp_path) is listed, trained and
compared from the command line; a module that cannot be imported is one line naming it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedheads.algorithms import _REGISTRY
from fedheads.cli import main
from tests.store_doubles import assert_one_line
from tests.test_fedheads_cli import _write_store

DOC = Path(__file__).resolve().parents[1] / "docs" / "custom_algorithm.md"


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """tmp_path holding `my_ridge.py` (the documented algorithm); the registry, sys.path and
    sys.modules are restored afterwards (they are process-wide)."""
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    (tmp_path / "my_ridge.py").write_text(code)
    (tmp_path / "broken_plugin.py").write_text("raise ValueError('bad config\\nsecond line')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("FEDHEADS_PLUGINS", raising=False)
    _REGISTRY.pop("ridge", None)
    yield tmp_path
    _REGISTRY.pop("ridge", None)
    for m in ("my_ridge", "broken_plugin"):
        sys.modules.pop(m, None)


def test_plugin_algorithm_is_listed_and_trains(plugin_dir, monkeypatch):
    store = _write_store(plugin_dir)
    runner = CliRunner()
    out = plugin_dir / "run"
    args = ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "ridge", "--rounds", "1",
            "--seeds", "0", "--set", "lam=0.1", "--quiet", "--out", str(out)]
    without = runner.invoke(main, args)  # not registered yet: the CLI does not know it
    assert without.exit_code == 2 and "ridge" in without.output
    monkeypatch.syspath_prepend(str(plugin_dir))
    listed = runner.invoke(main, ["--plugin", "my_ridge", "algorithms"])
    assert listed.exit_code == 0, listed.output
    assert re.search(r"^ridge\s+Federated ridge-regression head", listed.output, re.M)
    res = runner.invoke(main, ["--plugin", "my_ridge", *args])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "results.json").read_text())
    assert result["algorithm"] == "ridge" and result["accuracy"]["mean"] > 50  # separable toy clusters


def test_plugins_from_the_environment_and_the_current_directory(plugin_dir, monkeypatch):
    store = _write_store(plugin_dir)
    monkeypatch.chdir(plugin_dir)  # a console script has no cwd on sys.path: the loader adds it, last
    monkeypatch.setenv("FEDHEADS_PLUGINS", "my_ridge")
    res = CliRunner().invoke(main, ["compare", "--store", str(store), "--backbones", "synth", "--algorithms",
                                    "ridge,fedncm", "--rounds", "1", "--seeds", "0", "--quiet", "--out", "cmp"])
    assert res.exit_code == 0, res.output
    assert set(json.loads((plugin_dir / "cmp" / "results.json").read_text())["algorithms"]) == {"ridge", "fedncm"}
    assert sys.path[-1] == str(plugin_dir)


@pytest.mark.parametrize("flag, needles", [
    ("no_such_plugin_mod", ("plugin no_such_plugin_mod", "cannot import", "'no_such_plugin_mod'")),
    ("broken_plugin", ("plugin broken_plugin", "ValueError", "bad config second line")),
    ("my_ridge.py", ("plugin 'my_ridge.py'", "not a module name")),
])
def test_plugin_errors_are_one_line_naming_the_module(plugin_dir, monkeypatch, flag, needles):
    monkeypatch.syspath_prepend(str(plugin_dir))
    res = CliRunner().invoke(main, ["--plugin", flag, "algorithms"])
    assert_one_line(res, 2, *needles)


def test_env_and_flags_are_merged_in_order_once(monkeypatch):
    from embedcache.plugins import plugin_names

    assert plugin_names(("b", "c"), env="a, b c") == ["a", "b", "c"]
    assert plugin_names((), env="") == plugin_names((), env=None) == []
