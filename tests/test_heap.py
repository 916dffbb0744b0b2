"""The heap policy (fedheads/run/allocator.py): freed large blocks are reused inside a cell, local workers
start with it, and the driver's environment is put back; it is opt-in at the edge (the `fedheads`
command, sweep workers through their environment), never taken by the Python API."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from fedheads.run import allocator as heap

glibc = pytest.mark.skipif(not heap.reuse_env(), reason="glibc only")


# Run in a fresh process: in a test worker that ran other tests first, a large free chunk left in
# the heap can serve the probe's block without any mapping (the check then failed in one full run).
_PROBE = r"""
import ctypes, json
import torch
from fedheads.run import allocator as heap

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
# After the block: larger than the free chunks the two blocks above leave in the heap (128 MB if they
# coalesce), which glibc hands out before it maps anything; with something allocated after them
# (torch's threads, on a loaded machine) they stay there, and a 64 MB probe was served from them.
out.append(mapped_for_a_large_block(256 << 20))
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
    assert after >= 256 << 20


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


def test_sweep_workers_get_the_reuse_env_and_the_policy():
    from pipelines import sweep

    assert sweep.WORKER_ENV == {**heap.reuse_env(), heap.POLICY_ENV: "glibc"}


class _Glibc:
    """Stands in for glibc's mallopt and malloc_trim: records every call."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple] = []
        monkeypatch.setattr(heap, "_MALLOPT", lambda *a: self.calls.append(("mallopt", *a)) or 1)
        monkeypatch.setattr(heap, "_TRIM", lambda *a: self.calls.append(("trim", *a)) or 1)
        monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)  # not a sweep worker's environment
        monkeypatch.delenv(heap.POLICY_ENV, raising=False)

    def mallopts(self) -> list[tuple]:
        return [c for c in self.calls if c[0] == "mallopt"]


@pytest.fixture
def libc(monkeypatch) -> _Glibc:
    return _Glibc(monkeypatch)


@pytest.fixture(scope="module")
def skewed_store(tmp_path_factory):
    import numpy as np

    from embedcache.store.importer import import_features

    root = tmp_path_factory.mktemp("heap")
    rng = np.random.default_rng(0)
    store = root / "s.zarr"
    for i, n in enumerate((4, 30, 6, 28)):
        for split, m in (("train", n), ("test", 3)):
            f = root / f"c{i}-{split}.npz"
            np.savez(f, features=rng.normal(size=(m, 4)).astype("f4"), labels=rng.integers(0, 2, m))
            import_features(store, f, backbone="b", client=f"c{i}", split=split, classes=["k0", "k1"])
    return store


@pytest.mark.parametrize("layout", ["padded", "bucketed"])
def test_the_python_api_leaves_the_allocator_alone(libc, skewed_store, tmp_path, layout):
    """`fedheads.train` / `compare` from Python (a notebook): no mallopt, no malloc_trim, whether
    the features come from a store or arrays, padded or in size buckets, in memory or written."""
    import numpy as np

    import fedheads

    fedheads.train(str(skewed_store), "fedavg", backbones="b", rounds=1, seeds=0, device="cpu", layout=layout)
    fedheads.compare(str(skewed_store), ["fedavg", "fedncm"], backbones="b", rounds=1, seeds=0, device="cpu",
                     layout=layout, out=tmp_path / "cmp")
    arrays = {f"c{i}": (np.ones((n, 3), "f4"), np.arange(n) % 2, np.ones((2, 3), "f4"), np.array([0, 1]))
              for i, n in enumerate((3, 40))}
    fedheads.train(arrays, "fedavg", rounds=1, seeds=0, device="cpu", layout=layout)
    assert libc.calls == []


def test_the_fedheads_command_chooses_the_heap_policy(libc, skewed_store, tmp_path):
    """`fedheads train` (the CLI) runs the process's heap its way: one arena, freed blocks kept
    for reuse while padded data trains, freed memory handed back after the load."""
    from click.testing import CliRunner

    from fedheads.cli import main

    args = ["train", "--store", str(skewed_store), "--backbones", "b", "--algorithm", "fedavg", "--rounds", "1",
            "--seeds", "0", "--device", "cpu", "--quiet", "--layout", "padded", "--out", str(tmp_path / "run")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    opts = libc.mallopts()
    assert ("mallopt", heap._M_ARENA_MAX, 1) in opts  # one_arena
    assert ("mallopt", heap._M_MMAP_MAX, 0) in opts  # reusing_freed_blocks
    assert ("trim", 0) in libc.calls


def test_the_engine_calls_its_hook_between_buckets_and_never_glibc(libc):
    from fed_tiny import tiny_fed

    from fedheads.algorithms.fedavg import FedAvg
    from fedheads.core.engine import run
    from fedheads.core.federation import LayoutConfig, to_layout

    data = to_layout(tiny_fed(M=6), LayoutConfig("bucketed", waste=1.0, bucket_clients=2))
    assert len(data.groups()) == 3
    between: list[int] = []
    run(FedAvg(), data, rounds=2, progress=False, between_buckets=lambda: between.append(1))
    assert len(between) == 2 * (3 + 3)  # after each bucket's client updates and evaluation, each round
    run(FedAvg(), data, rounds=1, progress=False)
    assert libc.calls == []


def test_training_reuses_freed_blocks_for_padded_data_only(monkeypatch):
    """The heap policy of the `fedheads` command keeps freed blocks for reuse on padded data
    (same shapes every round) and not on size buckets (a large federation: memory first); without
    a policy (the Python API) nothing is entered."""
    import contextlib

    from fed_tiny import tiny_fed

    import fedheads.run.train as runner
    from fedheads.core.federation import FedData, LayoutConfig, to_layout

    entered = []

    @contextlib.contextmanager
    def spy():
        entered.append(True)
        yield

    monkeypatch.setattr(heap, "reusing_freed_blocks", spy)
    opts = runner.TrainOptions(rounds=1, seeds=(0,), device="cpu", progress=False)
    padded = tiny_fed(M=6)
    runner.train_data(padded, ["b"], "fedavg", opts)
    assert entered == []
    runner.train_data(padded, ["b"], "fedavg", opts, heap=heap.GlibcHeap())
    assert entered == [True]
    buckets = to_layout(padded, LayoutConfig("bucketed", waste=1.0, bucket_clients=2))
    assert not isinstance(buckets, FedData)
    runner.train_data(buckets, ["b"], "fedavg", opts, heap=heap.GlibcHeap())
    assert entered == [True]


def test_a_cell_uses_the_policy_its_environment_chose(libc, monkeypatch):
    """Sweep workers get the policy through their environment at spawn (WORKER_ENV): a cell then
    hands its freed memory back at its end; in a process without it, nothing."""
    from pipelines import cells

    cell = {"config": {"kind": "nonsense"}, "paths": {}, "hash": "h", "labels": {}}
    monkeypatch.setattr(cells, "run_feddra", lambda *a: {})
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cells.run_cell(cell, d)
        assert libc.calls == []
        monkeypatch.setenv(heap.POLICY_ENV, "glibc")
        cells.run_cell(cell, d)
    assert libc.calls == [("trim", 0)]


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
