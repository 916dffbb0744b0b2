"""The sweep's heap policy (fedheads/heap.py): freed large blocks are reused inside a cell, local
workers start with it, and the driver's environment is put back."""

from __future__ import annotations

import ctypes
import os

import pytest

from fedheads import heap

glibc = pytest.mark.skipif(not heap.reuse_env(), reason="glibc only")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mapped_bytes() -> int:
    """Bytes glibc holds in blocks mapped on their own (mallinfo2().hblkhd)."""
    fn = ctypes.CDLL(None).mallinfo2
    fn.restype = _MallInfo2
    return int(fn().hblkhd)


def _mapped_for_a_large_block() -> int:
    import torch

    before = _mapped_bytes()
    t = torch.empty((64 << 20) // 4)  # over glibc's largest mmap threshold (32 MB)
    grew = _mapped_bytes() - before
    del t
    return grew


@glibc
def test_large_blocks_come_from_the_heap_inside_the_block_and_are_mapped_again_after():
    """Inside reusing_freed_blocks a large block is carved from the heap (so a freed one can be
    handed out again without the kernel zero-filling fresh pages); outside it, glibc's default
    maps every block over 32 MB on its own and unmaps it when freed."""
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc < 2.33: no mallinfo2")
    assert _mapped_for_a_large_block() >= 64 << 20
    with heap.reusing_freed_blocks():
        assert _mapped_for_a_large_block() == 0
    assert _mapped_for_a_large_block() >= 64 << 20


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
