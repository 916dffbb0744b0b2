"""The sweep's heap policy (fedheads/heap.py): freed large blocks are reused inside a cell, local
workers start with it, and the driver's environment is put back."""

from __future__ import annotations

import os

import pytest

from fedheads import heap

glibc = pytest.mark.skipif(not heap.reuse_env(), reason="glibc only")


def _in_heap(ptr: int) -> bool:
    """Whether address `ptr` lies in the process's brk heap (not in a block mapped on its own)."""
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                return lo <= ptr < hi
    return False


@glibc
def test_large_blocks_come_from_the_heap_inside_the_block_and_are_mapped_again_after():
    """Inside reusing_freed_blocks a large block is carved from the heap (so a freed one can be
    handed out again without the kernel zero-filling fresh pages); outside it, glibc's default
    maps every block over 32 MB on its own and unmaps it when freed."""
    import torch

    n = (64 << 20) // 4  # over glibc's largest mmap threshold (32 MB)
    assert not _in_heap(torch.empty(n).data_ptr())
    with heap.reusing_freed_blocks():
        assert _in_heap(torch.empty(n).data_ptr())
    assert not _in_heap(torch.empty(n).data_ptr())


@glibc
def test_local_workers_start_with_the_env_and_the_driver_gets_its_own_back():
    from embedcache.distributed import dask_client

    keys = list(heap.REUSE_ENV) + ["FEDHEADS_HEAP_PROBE"]
    before = {k: os.environ.get(k) for k in keys}
    env = {**heap.reuse_env(), "FEDHEADS_HEAP_PROBE": "1"}
    with dask_client("local:1", worker_env=env) as client:
        seen = client.submit(lambda: {k: os.environ.get(k) for k in keys}, pure=False).result(timeout=60)
    assert seen == env
    assert {k: os.environ.get(k) for k in keys} == before


def test_sweep_workers_get_the_reuse_env():
    from pipelines import sweep

    assert sweep.WORKER_ENV == heap.reuse_env()
