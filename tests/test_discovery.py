"""Discovery instead of lists: a file dropped into fedheads/algorithms/ is an algorithm (listed,
trained on both engines with equal results), a file dropped into pipelines/ is an experiment
(listed and run), and an installed package adds algorithms and backbones through entry points,
their names known before torch loads. Each runs on a copy of the packages in a fresh interpreter,
so nothing is written into this checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_fedheads_cli import _write_store

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "custom_algorithm.md"

EXPERIMENT = '''
from pipelines.spec import BackboneSet, DataRecipe, Experiment, Layout, Method, Point, ScaleSpec

_SMOKE = ScaleSpec(rounds=1, seeds=(0,), test_per_class=2, eval_every=1)
DIGITS = Experiment(
    name="dropped-digits", title="A dropped experiment file", paper="Dropped", source="Table 1",
    summary="FedNCM on the embedded digits, one client per domain.",
    methods=(Method("FedNCM", "fedncm"),),
    points=(Point((("dataset", "Digit-5"),), DataRecipe("digit5", "feature-shift", train_per_class=3),
                  BackboneSet("DigitNet", paper=("digitnet-builtin",), standin=("digitnet-builtin",))),),
    layout=Layout(rows=("method",), columns=("dataset",)), rounds=1,
    scales=(("smoke", _SMOKE), ("ci", _SMOKE), ("paper", _SMOKE)))
PAPERS = {"Dropped": "A dropped paper, 2026"}
'''


def _copy(tmp: Path, *packages: str) -> Path:
    root = tmp / "site"
    for p in packages:
        shutil.copytree(REPO / p, root / p, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _run(args: list[str], path: list[Path], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    env.pop("FEDHEADS_PLUGINS", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


FEDHEADS = ["-c", "import sys; from fedheads.cli import main; sys.exit(main())"]


def test_an_algorithm_file_dropped_into_the_package_is_listed_and_trains_on_both_engines(tmp_path):
    """docs/custom_algorithm.md's ridge head saved as fedheads/algorithms/ridge.py, nothing else
    edited: `fedheads algorithms` lists it and both engines train it to the same head."""
    root = _copy(tmp_path, "fedheads")
    (root / "fedheads" / "algorithms" / "ridge.py").write_text(re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0])
    listed = _run([*FEDHEADS, "algorithms"], [root], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^ridge\s+Federated ridge-regression head", listed.stdout, re.M), listed.stdout
    store = _write_store(tmp_path)
    acc = {}
    for engine in ("vectorized", "loop"):
        out = tmp_path / engine
        r = _run([*FEDHEADS, "train", "--store", str(store), "--backbones", "synth", "--algorithm", "ridge", "--rounds",
                  "1", "--seeds", "0", "--engine", engine, "--set", "lam=0.1", "--quiet", "--out", str(out)], [root], tmp_path)
        assert r.returncode == 0, r.stderr
        res = json.loads((out / "results.json").read_text())
        acc[engine] = {c: v["mean"] for c, v in res["per_client"].items()}
    assert acc["vectorized"] == pytest.approx(acc["loop"], abs=1e-9) and min(acc["loop"].values()) > 50


def test_an_experiment_file_dropped_into_pipelines_is_listed_and_runs(tmp_path):
    root = _copy(tmp_path, "pipelines")
    (root / "pipelines" / "exp_dropped.py").write_text(EXPERIMENT)
    listed = _run(["-m", "pipelines", "list"], [root], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^dropped-digits\s+Dropped Table 1\s+1\s+1\s+1\s+0\s+A dropped experiment file", listed.stdout,
                     re.M), listed.stdout
    r = _run(["-m", "pipelines", "run", "dropped-digits", "--scale", "smoke", "--scheduler", "serial", "--quiet",
              "--out", str(tmp_path / "runs")], [root], tmp_path)
    assert r.returncode == 0, r.stderr
    report = (tmp_path / "runs" / "dropped-digits" / "report.md").read_text()
    assert "A dropped paper, 2026" in report and "FedNCM" in report


PLUGIN = '''
import fedheads
from fedheads.algorithms.fedncm import FedNCM, FedNCMConfig
from embedcache.backbones import register_backbone
from embedcache.backbones.digitnet import _build as _digitnet

fedheads.register_algorithm("ep-ncm", lambda **kw: FedNCM(FedNCMConfig(**kw)), config=FedNCMConfig,
                            description="FedNCM under another name, from an installed package")


def _net(wd, dev):
    bb = _digitnet(wd, dev)
    bb.name = "ep-net"
    return bb


register_backbone("ep-net", _net, description="digitnet under another name")
'''


def _installed_plugin(tmp: Path) -> Path:
    """A package installed by its metadata alone: a dist-info with entry points in both groups."""
    site = tmp / "plugins"
    dist = site / "ep_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedheads.algorithms]\nep-ncm = ep_plugin\n\n"
                                           "[embedcache.backbones]\nep-net = ep_plugin\n")
    (site / "ep_plugin.py").write_text(PLUGIN)
    return site


def test_installed_entry_points_register_algorithms_and_backbones(tmp_path):
    site = _installed_plugin(tmp_path)
    names = _run(["-c", "import json; from fedheads.algorithm_names import declared; "
                  "from embedcache.backbone_names import builtin_names; import sys; "
                  "print(json.dumps([[d.name for d in declared()], builtin_names(), 'torch' in sys.modules]))"],
                 [site], tmp_path)
    algs, bbs, torch_loaded = json.loads(names.stdout)
    assert "ep-ncm" in algs and "ep-net" in bbs and not torch_loaded  # known before torch loads
    store = _write_store(tmp_path)
    r = _run([*FEDHEADS, "train", "--store", str(store), "--backbones", "synth", "--algorithm", "ep-ncm", "--rounds", "1",
              "--seeds", "0", "--quiet", "--out", str(tmp_path / "run")], [site], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run" / "results.json").read_text())["algorithm"] == "ep-ncm"
    r = _run(["-c", "from embedcache.backbones import create_backbone; print(create_backbone('ep-net').feature_dim)"], [site],
             tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "128", r.stderr
