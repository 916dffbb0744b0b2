"""Discoverable settings: `fedheads algorithms NAME` lists every key `--set` takes (type,
default, doc, paper source), and an unknown key's error names the valid ones in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from embedcache.errors import UserError
from fedheads.algorithms import algorithm_info, create_algorithm, list_algorithms
from fedheads.cli import main
from fedheads.run.settings import settings_of, valid_keys
from tests.test_fedheads_cli import _write_store


def _invoke(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


@pytest.mark.parametrize("name", [i.name for i in list_algorithms()])
def test_every_listed_key_is_accepted_with_its_default(name):
    rows, _ = settings_of(name)
    assert rows, f"{name}: no settings listed"
    defaults = {r.key: r.default for r in rows}
    alg = create_algorithm(name, **defaults)  # every key at once: all accepted, nothing changes
    assert dataclasses.asdict(alg.cfg) == dataclasses.asdict(create_algorithm(name).cfg)
    cfg_fields = {f.name for f in dataclasses.fields(alg.cfg)} - {"optimizer"}
    missing = cfg_fields - set(defaults)
    assert missing == set(algorithm_info(name).fixed)  # only fields the registration fixes are left out
    for key in missing:  # and they are refused by name, with why
        with pytest.raises(UserError, match=f"^{key}: not a setting of {name}: "):
            create_algorithm(name, **{key: getattr(alg.cfg, key)})


def test_show_lists_type_default_doc_and_source():
    res = _invoke(["algorithms", "fedpcl"])
    assert res.exit_code == 0, res.output
    lines = {ln.split()[0]: ln for ln in res.output.splitlines() if ln.strip()}
    assert "0.07" in lines["tau"] and "float" in lines["tau"] and "[FedPCL Eq. 8/9]" in lines["tau"]
    assert "'adam'" in lines["optimizer_name"] and "0.001" in lines["lr"]
    assert "Sec. 5.1" in res.output  # the class docstring: where the defaults come from
    # lp's optimiser defaults are its own (SGD 0.1), not FedPCL's; `hidden` belongs to mlp
    lp = _invoke(["algorithms", "--show", "lp"]).output
    assert any(ln.startswith("lr ") and " 0.1 " in ln and "App. B" in ln for ln in lp.splitlines())
    assert "hidden" not in valid_keys("lp") and "hidden" in valid_keys("mlp")
    js = json.loads(_invoke(["algorithms", "lp", "--json"]).output)
    assert {s["key"] for s in js["settings"]} == set(valid_keys("lp"))


def test_unknown_algorithm_and_key_are_one_line(tmp_path):
    res = CliRunner().invoke(main, ["algorithms", "nope"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "unknown" in res.output
    store = _write_store(tmp_path)
    base = ["--store", str(store), "--backbones", "synth", "--rounds", "1", "--seeds", "0", "--quiet"]
    for cmd in (["train", "--algorithm", "fedpcl", "--set", "tua=0.1"],
                ["train", "--algorithm", "fedpcl", "--set", "fedpcl.tua=0.1"],
                ["compare", "--algorithms", "fedpcl,lp", "--set", "tua=0.1"]):
        res = CliRunner().invoke(main, cmd + base + ["--out", str(tmp_path / "o")])
        assert res.exit_code == 2, (cmd, res.output)
        assert res.output.count("\n") == 1 and "tua" in res.output and "tau" in res.output, res.output
        assert "temperature" not in res.output and not (tmp_path / "o").exists()
