"""benchmarks/gpu_check.sh cannot rot unnoticed: its Python part on hand-made inputs, its
refusal without CUDA, a failing section that does not stop the others, and (slow) the whole
dry run on the CPU, every section for real with quick settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check as G  # noqa: E402

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _script(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 600):
    e = {**os.environ, "PY": sys.executable, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=e, capture_output=True, text=True,
                          timeout=timeout)


def test_finds_the_fedpcl_80_case_in_any_layout():
    assert G.find_case({"cases": {"FedPCL@20": {"speedup": 2.0}, "FedPCL@80": {"speedup": 21.5}}}) == \
        ("FedPCL@80", {"speedup": 21.5})
    assert G.find_case({"x": [1], "y": {"fedpcl_80_clients": {"speedup": 3}}})[0] == "fedpcl_80_clients"
    assert G.find_case({"cases": {"FedPCL@800": {"speedup": 9.0}, "LP@80": {"speedup": 9.0}}}) is None


def test_junit_summary(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="tests.test_gpu" name="test_a"/>
      <testcase classname="tests.test_gpu" name="test_b"><failure message="AssertionError: x&#10;more">tb</failure></testcase>
      <testcase classname="tests.test_inference" name="test_c"><skipped message="needs CUDA"/></testcase>
    </testsuite></testsuites>""")
    s = G.junit_summary(xml)
    assert s == {"passed": ["test_gpu::test_a"], "failed": {"test_gpu::test_b": "AssertionError: x"},
                 "skipped": {"test_inference::test_c": "needs CUDA"}}


def test_merge_reports_sections_that_left_no_result(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    (work / "env.json").write_text(json.dumps({"status": "ok", "gpu": "Some GPU", "driver": "1.2",
                                               "torch": "2", "where": str(work / "x")}))
    (work / "env.rc").write_text("0 3 60")
    (work / "engine.json").write_text(json.dumps({"status": "ok", "target": {"what": "FedPCL@80", "target": 20.0,
                                                                            "measured": 25.0, "met": True}}))
    (work / "engine.rc").write_text("0 40 120")
    (work / "extract.rc").write_text("124 120 120")
    (work / "faiss.rc").write_text("1 2 60")
    (work / "faiss.log").write_text("Traceback\n  ...\nModuleNotFoundError: No module named 'faiss'\n\n")
    (work / "gpu_tests.json").write_text(json.dumps({"status": "ok"}))
    (work / "gpu_tests.rc").write_text("3 10 120")  # exited non-zero after writing "ok"
    res = G.merge("cuda", work, tmp_path / "out.json", "cmd")
    st = {k: v["status"] for k, v in res["sections"].items()}
    assert st["env"] == "ok" and st["engine"] == "ok" and st["install"] == "failed: did not run"
    assert st["extract"] == "failed: timed out after 120 s"
    assert st["faiss"] == "failed: exited 1: ModuleNotFoundError: No module named 'faiss'"
    assert st["gpu_tests"].startswith("failed: exited 3")
    assert res["device"]["gpu"] == "Some GPU" and res["targets"][0]["met"] is True
    assert res["ok"] is False and set(res["failed"]) == {"install", "extract", "faiss", "gpu_tests"}
    assert json.loads((tmp_path / "out.json").read_text())["sections"]["env"]["where"] == "<work>/x"


def test_refuses_to_run_without_cuda_unless_dry_run(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    r = _script(tmp_path, "--out", str(tmp_path / "o"), timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: ") and "--dry-run" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
    r = _script(tmp_path, "--bogus", timeout=60)
    assert r.returncode == 2 and "--bogus: unknown option" in r.stderr


def test_a_failing_section_does_not_stop_the_others(tmp_path):
    out = tmp_path / "o"
    r = _script(tmp_path, "--dry-run", "--out", str(out), timeout=300,
                env={"GPU_CHECK_ENGINE_ARGS": "--no-such-option", "GPU_CHECK_TIMEOUT_GPU_TESTS": "1",
                     "GPU_CHECK_TIMEOUT_EXTRACT": "1", "GPU_CHECK_TIMEOUT_FAISS": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads((out / "gpu_check.json").read_text())
    st = {k: v["status"] for k, v in res["sections"].items()}
    assert st["install"] == "ok" and st["env"] == "ok" and res["device"]["cpu_count"] == os.cpu_count()
    assert st["engine"].startswith("failed: bench_engine.py exited 2:") and "no-such-option" in st["engine"]
    for name in ("gpu_tests", "extract", "faiss"):
        assert st[name] == "failed: timed out after 1 s", name
    assert res["ok"] is False and "dry run" in res["mode"]


@pytest.mark.slow  # every section for real, quick settings: ~1-2 min on 2 busy cores
def test_the_whole_dry_run(tmp_path):
    out = tmp_path / "o"
    # the sections' own limits are sized for a lent GPU machine; on a loaded CPU (a second suite
    # beside this one) importing torch alone can take a minute: this test checks that they work
    slow = {f"GPU_CHECK_TIMEOUT_{s}": "400" for s in ("INSTALL", "ENV", "GPU_TESTS", "ENGINE", "EXTRACT", "FAISS")}
    r = _script(tmp_path, "--dry-run", "--out", str(out), env=slow, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((out / "gpu_check.json").read_text())
    st = {k: v["status"] for k, v in res["sections"].items()}
    assert st["install"] == "ok" and st["env"] == "ok" and st["extract"] == "ok", st
    assert st["gpu_tests"].startswith("skipped: dry run on the CPU: all") and \
        res["sections"]["gpu_tests"]["collected"] >= 7
    assert st["engine"] in ("ok", "skipped: no FedPCL case at 80 clients in bench_engine's JSON "
                                  "(quick dry-run settings)")
    assert res["sections"]["engine"]["bench"]  # bench_engine ran with --device cpu --out
    assert st["faiss"] == "ok" or st["faiss"].startswith("skipped: faiss GPU vs CPU not measured")
    rows = res["sections"]["extract"]["bench"]["results"]
    assert rows and all(r["images"] > 0 and r["forward_img_s"] > 0 for r in rows)
    text = (out / "gpu_check.json").read_text()
    assert str(REPO) not in text and str(tmp_path) not in text
