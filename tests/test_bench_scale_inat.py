"""bench_scale_inat.py's measuring parts: the floors child reports its rates, a child past the
memory limit is killed and recorded (not a crash), and unregistered heads are skipped with a note."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_scale_inat as B  # noqa: E402

TINY = {"mode": "gemm", "threads": 1, "profile": False, "gemm_n": 64, "gemm_d": 33, "gemm_batch": 2, "gemm_r": 2,
        "gemm_repeats": 2, "copy_bytes": 1 << 20}


def test_floors_child_reports_rates_and_memory():
    r = B.child(TINY, limit=1 << 40, timeout=300)
    assert "failed" not in r, r
    assert r["pooled"]["shape"] == [[33, 64], [64, 33]] and r["pooled"]["gflops"] > 0
    assert r["per_client"]["shape"] == [[2, 33, 2], [2, 2, 33]] and r["copy"]["gb_per_s"] > 0
    assert r["peak_rss"] >= r["baseline_rss"] > 0


def test_child_past_the_memory_limit_is_killed_and_recorded():
    r = B.child(TINY, limit=10 << 20, timeout=300)  # the interpreter alone is more than 10 MiB
    assert r["failed"].startswith("killed: resident memory") and "limit 0.0 GB" in r["failed"]
    s = B.summarise("fedncm", [r], feature_bytes=1)
    assert s["failed"] == r["failed"] and "seconds" not in s


def test_summarise_reports_multiples_of_the_feature_bytes():
    reps = [{"seconds": s, "peak_rss": 300, "baseline_rss": 100, "accuracy": 50.0, "load_seconds": 1.0,
             "round_seconds": [2.0], "eval_seconds": [0.5]} for s in (3.0, 1.0, 2.0)]
    s = B.summarise("fedncm", reps, feature_bytes=100)
    assert s["seconds"]["median"] == 2.0 and s["seconds"]["min"] == 1.0
    assert s["multiple_of_feature_bytes"]["median"] == 2.0 and s["round_seconds"]["median"] == 2.0


def test_registered_lists_the_algorithms():
    names = B.registered()
    assert {"fedncm", "lp"} <= names and "no-such-head" not in names


def test_profile_text_names_no_machine_directory():
    text = (f"1 0.1 0.1 {B.REPO}/fedheads/core/engine.py:240(client_updates)\n"
            "2 0.2 0.2 /opt/venv/lib/python3.11/site-packages/zarr/core/sync.py:124(sync)\n"
            "3 0.3 0.3 /usr/lib/python3.11/threading.py:295(wait)\n")
    assert B.sanitized(text).splitlines() == ["1 0.1 0.1 fedheads/core/engine.py:240(client_updates)",
                                              "2 0.2 0.2 <site-packages>/zarr/core/sync.py:124(sync)",
                                              "3 0.3 0.3 <lib/python3.11>/threading.py:295(wait)"]


def test_cases_take_settings_and_a_layout():
    assert B.parse_heads("fedncm,fedcof:dtype=float32,layout=streamed,fed3r:layout=streamed") == [
        "fedncm", "fedcof:dtype=float32,layout=streamed", "fed3r:layout=streamed"]
    assert B.case_args("fedcof:dtype=float32,layout=streamed") == ("fedcof", ["fedcof.dtype=float32"], "streamed")
    assert B.case_args("fedncm") == ("fedncm", [], "auto")
    assert B.case_args("lp") == ("lp", ["lp.local_models=false"], "auto")
