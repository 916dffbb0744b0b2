"""glibc heap policy: handing freed memory back to the OS between the size buckets of a round, and
keeping it for reuse inside a sweep's cells (no torch import).

Opt-in at the edge: the library never calls these by itself. The `fedheads` command chooses them
(one_arena, and GlibcHeap for `train` / `compare`), sweep workers get them through their
environment at spawn (worker_env, from_environment)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator


def _glibc(name: str, argtypes: list[object]) -> object:
    """The process's own libc function `name` returning int, or None where it has none (musl,
    macOS, Windows: glibc's heap knobs do not exist there)."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_TRIM = _glibc("malloc_trim", [ctypes.c_size_t])


def release_free_heap() -> None:
    """Give the pages of freed heap blocks back to the OS (glibc `malloc_trim(0)`; a no-op
    elsewhere). glibc keeps freed blocks below its mmap threshold (which rises to 32 MB) in its
    arenas, and the next bucket's temporaries have other shapes and large ones are mmapped, so they
    cannot reuse them: over a round's buckets that resident, unusable memory grows. Called between
    the size buckets of a round (core/engine.py); live tensors and the buffer pool are not touched.
    Measured at 1,000 clients (benchmarks/bench_scale.py, one run each): FedPCL's peak 1.71x the
    feature bytes without it, 1.55x with it; FedNCM 1.20x and 1.16x."""
    if _TRIM is not None:
        _TRIM(0)


# glibc's mallopt parameters (malloc.h) and their documented defaults
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -3, -4, -8
_DEFAULT_MMAP_MAX = 65536
# where glibc's dynamic thresholds settle once a block of its largest mmap threshold (32 MiB on 64-bit)
# has been freed, as in any process that frees large tensors: a mallopt of either turns the dynamic
# adjustment off for good, so leaving a block restores these instead of the 128 KiB start values
_SETTLED_MMAP_THRESHOLD, _SETTLED_TRIM_THRESHOLD = 32 << 20, 64 << 20
_KEEP = 2**31 - 1  # mallopt takes an int: the top 2 GiB of freed heap stay until release_free_heap()


_MALLOPT = _glibc("mallopt", [ctypes.c_int, ctypes.c_int]) if _TRIM is not None else None

# Worker processes started for a sweep (set before the process starts: glibc reads them once).
# Large tensors are carved from the heap, and freed ones stay there to be handed out again
# instead of going back to the OS: glibc otherwise maps every block over 32 MB afresh and unmaps
# it when freed, and the kernel zero-fills each new page. A cell frees and re-makes blocks of the
# same sizes every round (80 clients' [80, 1472, 256] weights, their copies and deltas): FedAvg at
# 80 clients, 200 rounds, in a local worker took 95.8 CPU s with glibc's default and 54.9 with
# this, peak RSS 1.64 -> 1.72 GB (an exact-size freed block does not always fit the next 64-byte
# aligned request, so the heap settles a little above the peak). One arena: a worker runs its
# cell in an executor thread, and a thread's own arena maps large blocks whatever
# MALLOC_MMAP_MAX_ says.
REUSE_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(_KEEP), "MALLOC_ARENA_MAX": "1"}


def one_arena() -> None:
    """Let every thread this process starts from now on allocate from glibc's main arena
    (mallopt M_ARENA_MAX = 1; a no-op where the C library is not glibc). The `fedheads` command
    calls it before it reads a store: glibc otherwise gives each thread that allocates (zarr's I/O
    loop, its decompressors, torch's intra-op workers) an arena of its own, and what they free
    there stays resident, beside the training thread's heap, until the process ends. Measured on
    bench_scale's 1,000-client federation (one run each, MALLOC_ARENA_MAX=1 in the environment
    against none): FedPCL's peak 1.52x -> 1.48x the feature bytes. Arenas made before the call stay."""
    if _MALLOPT is not None:
        _MALLOPT(_M_ARENA_MAX, 1)


def reuse_env() -> dict[str, str]:
    """REUSE_ENV where the C library is glibc, else {} (other allocators keep their own rules)."""
    return dict(REUSE_ENV) if _MALLOPT is not None else {}


_reusing = False  # inside reusing_freed_blocks


@contextlib.contextmanager
def reusing_freed_blocks() -> Iterator[None]:
    """In this process, for the block's duration: what REUSE_ENV does for a worker (its main
    arena only: for work on the thread that enters it), then the thresholds glibc's own dynamic
    ones settle at (_SETTLED_*: glibc has no way back to the dynamic ones) and the freed memory
    given back (release_free_heap). The resident size stays at the block's peak until it
    ends. A no-op where the C library is not glibc, inside another such block (the outer one
    keeps its policy), and in a process started with REUSE_ENV (a sweep's worker keeps it)."""
    global _reusing
    if _MALLOPT is None or _reusing or os.environ.get("MALLOC_MMAP_MAX_") == REUSE_ENV["MALLOC_MMAP_MAX_"]:
        yield
        return
    _reusing = True
    _MALLOPT(_M_MMAP_MAX, 0)
    _MALLOPT(_M_TRIM_THRESHOLD, _KEEP)
    try:
        yield
    finally:
        _MALLOPT(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        _MALLOPT(_M_MMAP_THRESHOLD, _SETTLED_MMAP_THRESHOLD)
        _MALLOPT(_M_TRIM_THRESHOLD, _SETTLED_TRIM_THRESHOLD)
        _reusing = False
        release_free_heap()


# The process environment that opts a process into GlibcHeap (from_environment): sweep workers
# are spawned with it, as with REUSE_ENV.
POLICY_ENV = "FEDHEADS_HEAP"


class GlibcHeap:
    """The heap policy of a training process, for the edge that owns the process to choose (the
    `fedheads train` / `compare` commands, sweep workers): nothing here runs unless a caller
    passes this object, so a notebook calling `fedheads.train` keeps its allocator as it is.

    Padded data trains inside `reusing_freed_blocks` (every round allocates blocks of the same
    shapes, which glibc would otherwise map and zero-fill afresh each time); bucketed data (a
    large, skewed federation) keeps glibc's defaults, memory first, with the heap handed back
    between buckets (the engine's `between_buckets` hook) and after a store is loaded."""

    def training(self, padded: bool) -> contextlib.AbstractContextManager[None]:
        """The block a run's rounds train inside (`padded`: the data is one dense tensor)."""
        return reusing_freed_blocks() if padded else contextlib.nullcontext()

    def between_buckets(self) -> None:
        """core.engine.run's `between_buckets` hook: a bucket's freed temporaries go back to the OS."""
        release_free_heap()

    def after_load(self) -> None:
        """The parsed metadata of every shard and the read buffers go back to the OS."""
        release_free_heap()

    def __repr__(self) -> str:
        return "GlibcHeap()"


def from_environment() -> GlibcHeap | None:
    """GlibcHeap where this process was started with POLICY_ENV=glibc (a sweep's worker), else None."""
    return GlibcHeap() if os.environ.get(POLICY_ENV) == "glibc" else None


def worker_env() -> dict[str, str]:
    """What a sweep's worker process is started with: REUSE_ENV (on glibc) and POLICY_ENV."""
    return {**reuse_env(), POLICY_ENV: "glibc"}
