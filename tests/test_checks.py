"""Names and plain values are refused before torch, timm or dask load (a typo used to take 9-28 s
to be refused), with the nearest valid name; the static name tables equal the registries."""

from __future__ import annotations

import json
import subprocess
import sys

import kill_helpers

from embedcache import backbone_names
from fedheads.run import checks


def _fresh(code: str) -> str:
    """stdout of `code` in a fresh interpreter (no test-registered algorithms or backbones)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600,
                          env=kill_helpers.subprocess_env()).stdout


def test_static_names_equal_the_registries():
    got = json.loads(_fresh(
        "import json\n"
        "from fedheads.algorithms import list_algorithms\n"
        "from embedcache.backbones import registered_names\n"
        "from embedcache.backbones.registry import registered_families\n"
        "print(json.dumps([[i.name for i in list_algorithms()], registered_names(), registered_families()]))\n"))
    assert checks.known_algorithms() == got[0] or sorted(checks.known_algorithms()) == got[0]  # read without importing
    assert got[1:] == [backbone_names.builtin_names(), list(backbone_names.family_prefixes())]
    from fedheads.alignment.runner import BASELINES
    from fedheads.finetuning.heads import HEADS

    assert tuple(BASELINES) == checks.FEDDRA_BASELINES and tuple(HEADS) == checks.FINETUNE_HEADS


REFUSALS = [
    (["train", "--algorithm", "fedpc"], "unknown algorithm 'fedpc'; did you mean fedpcl?"),
    (["compare", "--algorithms", "lp,fedprot"], "unknown algorithm 'fedprot'; did you mean fedproto?"),
    (["train", "--algorithm", "lp", "--lr", "nan"], "--lr nan: must be a finite number"),
    (["train", "--algorithm", "lp", "--seeds", "0,0"], "seed 0 given more than once"),
    (["train", "--algorithm", "lp", "--set", "lr=Infinity"], "--set lr=inf: must be a finite number"),
]
LIVE = [
    (["finetune", "--manifest", "m.json", "--store", "s", "--backbone", "resnet20-cifar1"],
     "resnet20-cifar1: unknown backbone; did you mean resnet20-cifar10?"),
    (["finetune", "--manifest", "m.json", "--store", "s", "--backbone", "resnet20-cifar10", "--head", "fedncn"],
     "unknown head 'fedncn'; did you mean fedncm?"),
    (["feddra", "--manifest", "m.json", "--image-encoder", "resnet20-cifar10", "--text-encoder", "minilm-l6-v3"],
     "minilm-l6-v3: unknown backbone; did you mean minilm-l6-v2?"),
    (["feddra", "--manifest", "m.json", "--image-encoder", "resnet20-cifar10", "--text-encoder", "minilm-l6-v2",
      "--baseline", "feddra,fedprx"], "unknown baseline 'fedprx'; did you mean fedprox?"),
    (["simulate", "--store", "s", "--backbones", "synth", "--algorithm", "fednc"],
     "unknown algorithm 'fednc'; did you mean fedncm?"),
]


def test_typos_are_refused_before_torch_loads(tmp_path):
    from test_fedheads_cli import _write_store

    store = _write_store(tmp_path)
    (tmp_path / "m.json").write_text("{}")
    train = ["--store", str(store), "--backbones", "synth", "--rounds", "1", "--quiet", "--out", str(tmp_path / "o")]
    cases = [(a + train, want) for a, want in REFUSALS] + [(a + ["--out", str(tmp_path / "o")], w) for a, w in LIVE]
    cases.append((["train", "--store", str(store), "--backbones", "synht", "--algorithm", "lp", "--out",
                   str(tmp_path / "o")], "backbone 'synht': not in store"))
    code = (
        "import json, os, sys\n"
        "from click.testing import CliRunner\n"
        "from fedheads.cli import main as fh\n"
        "from embedcache.cli import main as ec\n"
        f"os.chdir({str(tmp_path)!r})\n"
        "out = []\n"
        f"for args, _ in {cases!r}:\n"
        "    r = CliRunner().invoke(fh, args)\n"
        "    out.append([r.exit_code, r.output, sorted(m for m in ('torch', 'timm', 'dask') if m in sys.modules)])\n"
        "r = CliRunner().invoke(ec, ['extract', '--manifest', 'm.json', '--backbones', 'timm:resnet18,resnt18-birds', "
        "'--store', 's.zarr'])\n"
        "out.append([r.exit_code, r.output, sorted(m for m in ('torch', 'timm', 'dask') if m in sys.modules)])\n"
        "print(json.dumps(out))\n")
    got = json.loads(_fresh(code).strip().splitlines()[-1])
    wants = [w for _, w in cases] + ["resnt18-birds: unknown backbone; did you mean resnet18-birds?"]
    for (rc, output, loaded), want in zip(got, wants):
        lines = output.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and want in lines[0], output
        assert loaded == [], (want, loaded)
    assert not (tmp_path / "o").exists()


def test_the_late_registry_checks_suggest_too():
    import pytest

    from embedcache.backbones import create_backbone
    from embedcache.errors import UserError
    from fedheads.algorithms import create_algorithm

    with pytest.raises(UserError, match="unknown algorithm 'fedpcll'; did you mean fedpcl"):
        create_algorithm("fedpcll")
    with pytest.raises(UserError, match="resnet-20-cifar10: unknown backbone; did you mean resnet20-cifar10"):
        create_backbone("resnet-20-cifar10")


def test_a_head_missing_from_the_finetune_table_is_found_in_the_registry(monkeypatch):
    """The --head table is a fast path: an algorithm it does not list (a new method is one file)
    whose state defines a linear head is looked up in the registry."""
    monkeypatch.setattr(checks, "FINETUNE_HEADS", tuple(h for h in checks.FINETUNE_HEADS if h != "fed3r"))
    checks.check_algorithms(["fed3r"])
    checks.check_finetune_heads(["fed3r"])
    assert "fed3r" in checks.finetune_heads(["fed3r"]) and "fedavg" not in checks.finetune_heads(["fed3r"])
