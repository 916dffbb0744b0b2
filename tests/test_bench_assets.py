"""Benchmarks find data and weights the way the CLIs do (benchmarks/assets.py): with
$EMBEDCACHE_ASSETS set they read that tree and nothing else, wherever they are started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import store_doubles as d
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import assets  # noqa: E402
import bench_cached_vs_live  # noqa: E402


@pytest.fixture
def no_asset_env(monkeypatch):
    for k in ("EMBEDCACHE_ASSETS", "EMBEDCACHE_WEIGHTS"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_resolution_order(no_asset_env, tmp_path):
    mp = no_asset_env
    mp.chdir(tmp_path)  # ../shared is looked for beside the checkout, not the working directory
    shared = REPO.parent / "shared"
    expect = shared / "weights" if (shared / "weights").is_dir() else None
    if expect is not None:
        assert assets.weights_dir() == expect and assets.data_dir("x") == shared / "data" / "x"
    mp.setenv("EMBEDCACHE_ASSETS", str(tmp_path / "a"))
    assert assets.assets_dir() == tmp_path / "a"
    assert assets.data_dir("office_caltech10") == tmp_path / "a" / "data" / "office_caltech10"
    assert assets.weights_dir() == tmp_path / "a" / "weights"
    mp.setenv("EMBEDCACHE_WEIGHTS", str(tmp_path / "w"))
    assert assets.weights_dir() == tmp_path / "w"
    assert assets.weights_dir(tmp_path / "flag") == tmp_path / "flag"
    assert assets.display_source(f"imagefolder:{tmp_path / 'a' / 'data' / 'o'}") == "imagefolder:<assets>/data/o"
    assert assets.display_source("builtin:digits") == "builtin:digits"


def test_cached_vs_live_reads_the_assets_it_is_given(no_asset_env, tmp_path):
    no_asset_env.setenv("EMBEDCACHE_ASSETS", str(tmp_path))  # holds no Office-Caltech-10
    r = CliRunner().invoke(bench_cached_vs_live.main, ["--rounds", "1", "--live-rounds", "1"])
    assert r.exit_code != 0
    assert str(tmp_path / "data" / "office_caltech10") in str(r.exception)


def test_extract_benchmark_on_a_symlinked_assets_tree(no_asset_env, tmp_path):
    """Data and weights exist only in the tree $EMBEDCACHE_ASSETS points to (symlinks): the
    benchmark must find both, started from another directory."""
    import torch
    import torchvision

    real = d.make_imagefolder(tmp_path / "real", domains=("a", "b"), per_class=2, size=24)
    tree = tmp_path / "assets"
    (tree / "data").mkdir(parents=True)
    (tree / "data" / "office_caltech10").symlink_to(real, target_is_directory=True)
    (tmp_path / "w" / "tv").mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(torchvision.models.mobilenet_v3_small().state_dict(), tmp_path / "w" / "tv" / "mobilenet_v3_small.pth")
    (tree / "weights").symlink_to(tmp_path / "w", target_is_directory=True)
    out = tmp_path / "extract.json"
    env = {**os.environ, "EMBEDCACHE_ASSETS": str(tree), "EMBEDCACHE_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_extract.py"), "--per-domain", "3",
                           "--backbones", "tv:mobilenet_v3_small", "--batch-size", "4", "--num-workers", "1",
                           "--no-dask", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["data"] == "imagefolder:<assets>/data/office_caltech10" and res["device"] == "cpu"
    (row,) = res["results"]
    assert row["backbone"] == "tv:mobilenet_v3_small" and row["images"] == 6 and row["feature_dim"] > 0
    assert "dask_local2_s" not in row
