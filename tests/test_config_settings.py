"""One configuration mechanism: an algorithm's settings are the fields of its declared config
dataclass, documented by their `setting()` metadata (no source file needed); `--set` keys are
checked against those fields and the algorithm is built once per run, never once per key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from store_doubles import assert_one_line
from test_fedheads_cli import _write_store

from fedheads.algorithms import _REGISTRY, create_algorithm
from fedheads.cli import main
from fedheads.settings import settings_of, settings_table


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _write_store(tmp_path_factory.mktemp("cs"))


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _train(store: Path, out: Path, *extra: str, algorithm: str = "fedncm") -> list:
    return ["train", "--store", store, "--backbones", "synth", "--algorithm", algorithm, "--rounds", "1",
            "--seeds", "0,1", "--device", "cpu", "--quiet", "--out", out, *extra]


@pytest.fixture
def builds(monkeypatch):
    """{algorithm: how many times its factory ran}, for the registered algorithms."""
    calls: dict[str, int] = {}
    for name, info in list(_REGISTRY.items()):
        def counted(_name=name, _f=info.factory, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _f(**kw)
        monkeypatch.setitem(_REGISTRY, name, dataclasses.replace(info, factory=counted))
    return calls


SOURCE = '''
from dataclasses import dataclass
from fedheads.core.config import setting

@dataclass(frozen=True)
class CellConfig:
    """Defined in a notebook cell: no file holds this source."""

    alpha: float = setting(0.5, "mixing weight of the two heads", source="Some paper Sec. 3, Eq. 2")
    steps: int = setting(3, "inner steps")
'''


def test_docs_come_from_field_metadata_without_a_source_file(monkeypatch):
    scope: dict = {}
    exec(compile(SOURCE, "<notebook cell>", "exec"), scope)
    cls = scope["CellConfig"]
    from fedheads.algorithms import register_algorithm
    from fedheads.algorithms.fedncm import FedNCM

    monkeypatch.setitem(_REGISTRY, "cell", _REGISTRY["fedncm"])  # replaced below; restored after the test
    register_algorithm("cell", lambda **kw: FedNCM(), description="a notebook algorithm", config=cls)
    rows = {r.key: r for r in settings_of("cell")[0]}
    assert rows["alpha"].doc == "mixing weight of the two heads" and rows["alpha"].source == "Some paper Sec. 3, Eq. 2"
    assert rows["steps"].default == 3 and rows["steps"].doc == "inner steps" and rows["steps"].source == ""
    table = settings_table("cell")
    assert "mixing weight of the two heads [Some paper Sec. 3, Eq. 2]" in table and "no file holds" in table


def test_an_inapplicable_key_is_refused_by_name_and_nothing_is_built(store, tmp_path, builds):
    res = _cli(*_train(store, tmp_path / "o", "--set", "lr=0.1"))  # fedncm has no client optimiser
    assert_one_line(res, 2, "--set lr: not a setting of fedncm")
    assert builds == {} and not (tmp_path / "o").exists()
    res = _cli(*_train(store, tmp_path / "o", "--set", "hidden=8", algorithm="lp"))  # mlp's, fixed for lp
    assert_one_line(res, 2, "--set hidden: not a setting of lp")
    assert builds == {}


def test_a_run_builds_its_algorithm_once_with_every_key(store, tmp_path, builds):
    res = _cli(*_train(store, tmp_path / "o", "--set", "init=fedncm", "--set", "server_lr=0.5", "--lr", "0.05",
                       algorithm="lp"))
    assert res.exit_code == 0, res.output
    assert builds == {"lp": 1}  # two seeds, config.json and config.yaml: one build
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["algorithm_kwargs"] == {"init": "fedncm", "server_lr": 0.5, "lr": 0.05}
    assert cfg["algorithm_config"]["optimizer"]["lr"] == 0.05
    kept = yaml.safe_load((tmp_path / "o" / "config.yaml").read_text())["set"]
    assert kept["init"] == "fedncm" and kept["lr"] == 0.05 and "hidden" not in kept


def test_compare_applies_a_key_where_it_is_a_field(store, tmp_path, builds):
    res = _cli("compare", "--store", store, "--backbones", "synth", "--algorithms", "fedncm,lp,mlp", "--rounds", "1",
               "--seeds", "0", "--device", "cpu", "--quiet", "--out", tmp_path / "c",
               "--set", "lr=0.05", "--set", "hidden=8")
    assert res.exit_code == 0, res.output
    assert builds == {"fedncm": 1, "lp": 1, "mlp": 1}
    kw = {a: json.loads((tmp_path / "c" / a / "config.json").read_text()) for a in ("fedncm", "lp", "mlp")}
    assert kw["fedncm"]["algorithm_kwargs"] == {} and sorted(kw["fedncm"]["ignored_options"]) == ["hidden", "lr"]
    assert kw["lp"]["algorithm_kwargs"] == {"lr": 0.05} and kw["lp"]["ignored_options"] == ["hidden"]
    assert kw["mlp"]["algorithm_kwargs"] == {"lr": 0.05, "hidden": 8}
    assert kw["mlp"]["algorithm_config"]["hidden"] == [8, 8]


def test_compare_refuses_a_key_no_algorithm_has(store, tmp_path, builds):
    res = _cli("compare", "--store", store, "--backbones", "synth", "--algorithms", "fedncm,lp", "--rounds", "1",
               "--seeds", "0", "--device", "cpu", "--quiet", "--out", tmp_path / "c", "--set", "hidden=8")
    assert_one_line(res, 2, "--set hidden: not a setting of fedncm, lp")
    assert builds == {}


def test_a_wrong_value_is_one_line_naming_the_algorithm(store, tmp_path):
    res = _cli(*_train(store, tmp_path / "o", "--set", "server_opt=nope", algorithm="lp"))
    assert_one_line(res, 2, "server_opt 'nope'")
    with pytest.raises(Exception, match="hidden: not a setting of lp: the linear probe has no hidden layer"):
        create_algorithm("lp", hidden=(4,))
