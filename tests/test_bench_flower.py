"""Smoke test of benchmarks/bench_flower.py --quick (engine and in-process simulation cases; the
loopback case is the deployment test's code path, tests/test_flower_deploy.py): it runs, writes a
self-describing JSON, and Flower's bytes per round grow under SecAgg+."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from flower_helpers import FLOWER_MISSING

pytest.importorskip("flwr", reason=FLOWER_MISSING)

REPO = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_json(tmp_path):
    out = tmp_path / "flower.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_flower.py"), "--quick", "--cases", "engine,simulation",
           "--rows", "64", "--dim", "16", "--classes", "4", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["machine"]["cpu_count"] >= 1 and res["rounds"] == 2
    cases = {(c["case"], c["secagg"]): c for c in res["cases"]}
    assert set(cases) == {("engine", False), ("simulation", False), ("simulation", True)}
    for c in cases.values():
        assert c["seconds_per_round"]["median"] > 0 and c["bytes_per_round"] > 0 and c["peak_rss_bytes"]["self"] > 0
        assert c["x_engine"] > 0 and len(c["loadavg_before"]) == 3
    assert cases[("simulation", True)]["bytes_per_round"] > cases[("simulation", False)]["bytes_per_round"]


def test_cases_must_include_the_engine(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_flower.py"), "--quick", "--cases", "simulation",
           "--out", str(tmp_path / "x.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "includes engine" in r.stderr and not (tmp_path / "x.json").exists()
