"""The sweep's heap policy (fedheads/heap.py): freed large blocks are reused inside a cell, local
workers start with it, and the driver's environment is put back."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from fedheads import heap

glibc = pytest.mark.skipif(not heap.reuse_env(), reason="glibc only")


# Run in a fresh process: in a test worker that ran other tests first, a large free chunk left in
# the heap can serve the probe's block without any mapping (the check then failed in one full run).
_PROBE = r"""
import ctypes, json
import torch
from fedheads import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

fn = ctypes.CDLL(None).mallinfo2
fn.restype = MallInfo2

def mapped_for_a_large_block(nbytes=64 << 20):  # default: over glibc's largest mmap threshold (32 MB)
    before = int(fn().hblkhd)  # bytes glibc holds in blocks mapped on their own
    t = torch.empty(nbytes // 4)
    grew = int(fn().hblkhd) - before
    del t
    return grew

out = [mapped_for_a_large_block()]
with heap.reusing_freed_blocks():
    out.append(mapped_for_a_large_block())
    with heap.reusing_freed_blocks():  # a nested block (a cell's training in a serial sweep)
        pass
    out.append(mapped_for_a_large_block())  # the outer block's policy holds
out.append(mapped_for_a_large_block())
print(json.dumps(out))
"""


@glibc
def test_large_blocks_come_from_the_heap_inside_the_block_and_are_mapped_again_after():
    """Inside reusing_freed_blocks a large block is carved from the heap (so a freed one can be
    handed out again without the kernel zero-filling fresh pages); outside it, glibc's default
    maps every block over 32 MB on its own and unmaps it when freed."""
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc < 2.33: no mallinfo2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's defaults
    p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    before, inside, after_nested, after = json.loads(p.stdout.strip().splitlines()[-1])
    assert before >= 64 << 20
    assert inside == 0 and after_nested == 0
    assert after >= 64 << 20


@glibc
def test_after_the_block_medium_blocks_come_from_the_heap_as_with_glibcs_settled_thresholds():
    """A mallopt turns glibc's dynamic thresholds off for good: leaving the block sets the values
    they settle at (32 MiB), not their 128 KiB start, so a 4 MiB tensor is not mapped and
    zero-filled afresh every time for the rest of the process."""
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc < 2.33: no mallinfo2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    probe = _PROBE.split("out = [")[0] + (
        "with heap.reusing_freed_blocks():\n    pass\n"
        "print(json.dumps([mapped_for_a_large_block(4 << 20) for _ in range(3)]))\n")
    p = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [0, 0, 0]


@glibc
def test_local_workers_start_with_the_env_and_the_driver_gets_its_own_back():
    from embedcache.distributed import dask_client

    keys = list(heap.REUSE_ENV) + ["FEDHEADS_HEAP_PROBE"]
    before = {k: os.environ.get(k) for k in keys}
    env = {**heap.reuse_env(), "FEDHEADS_HEAP_PROBE": "1"}
    with dask_client("local:1", worker_env=env) as client:
        seen = client.submit(lambda: {k: os.environ.get(k) for k in keys}, pure=False).result(timeout=300)
    assert seen == env
    assert {k: os.environ.get(k) for k in keys} == before


def test_sweep_workers_get_the_reuse_env():
    from pipelines import sweep

    assert sweep.WORKER_ENV == heap.reuse_env()


def test_training_reuses_freed_blocks_for_padded_data_only(monkeypatch):
    """fedheads train keeps freed blocks for reuse on padded data (same shapes every round) and
    not on size buckets (a large federation: memory first)."""
    import contextlib

    from fed_tiny import tiny_fed

    import fedheads.runner as runner
    from fedheads.data import FedData, to_layout
    from fedheads.layout import LayoutConfig

    entered = []

    @contextlib.contextmanager
    def spy():
        entered.append(True)
        yield

    monkeypatch.setattr(runner, "reusing_freed_blocks", spy)
    opts = runner.TrainOptions(rounds=1, seeds=(0,), device="cpu", progress=False)
    padded = tiny_fed(M=6)
    runner.train_data(padded, ["b"], "fedavg", opts)
    assert entered == [True]
    buckets = to_layout(padded, LayoutConfig("bucketed", waste=1.0, bucket_clients=2))
    assert not isinstance(buckets, FedData)
    runner.train_data(buckets, ["b"], "fedavg", opts)
    assert entered == [True]


def test_the_heap_policy_benchmark_writes_both_modes(tmp_path):
    """benchmarks/bench_heap_policy.py end to end at its smallest (a smoke test, not a figure)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "hp.json"
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_heap_policy.py"), "--repeats", "1", "--rounds", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"on", "off"} and r["cpu_ratio_off_over_on"] > 0 and r["peak_ratio_on_over_off"] > 0
    assert r["runs"]["on"]["train_cpu_seconds"]["samples"][0] > 0
