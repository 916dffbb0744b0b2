"""zstd decompression of a frame's first bytes, into a caller's buffer, with one reused
decompression context per thread (Zstandard, RFC 8878: a frame's blocks decode in order, so a
prefix of the content needs only the blocks that hold it).

Why: zarr stores a shard's last chunk whole (padded to the chunk rows), so a 1-row shard of
1280-d float32 at 256 rows per chunk is a 1.3 MB frame; the reader needs its first 5 kB. numcodecs
decodes whole frames and creates a context per call, which dominated stores of many tiny shards.

The system libzstd is called through ctypes; where it cannot be loaded, numcodecs decodes the
whole frame and the prefix is copied (same bytes, slower). Bytes are never trusted here: the
reader checks every chunk's rows against their sha256.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any

import numpy as np
from numcodecs.zstd import Zstd

_FALLBACK = Zstd()
_local = threading.local()


class _InBuffer(ctypes.Structure):  # ZSTD_inBuffer
    _fields_ = [("src", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


class _OutBuffer(ctypes.Structure):  # ZSTD_outBuffer
    _fields_ = [("dst", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


def _load() -> Any:
    name = ctypes.util.find_library("zstd") or "libzstd.so.1"
    try:
        lib = ctypes.CDLL(name)
        lib.ZSTD_createDCtx.restype = ctypes.c_void_p
        lib.ZSTD_createDCtx.argtypes = []
        lib.ZSTD_freeDCtx.restype = ctypes.c_size_t
        lib.ZSTD_freeDCtx.argtypes = [ctypes.c_void_p]
        lib.ZSTD_DCtx_reset.restype = ctypes.c_size_t
        lib.ZSTD_DCtx_reset.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.ZSTD_decompressStream.restype = ctypes.c_size_t
        lib.ZSTD_decompressStream.argtypes = [ctypes.c_void_p, ctypes.POINTER(_OutBuffer), ctypes.POINTER(_InBuffer)]
        lib.ZSTD_isError.restype = ctypes.c_uint
        lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
        lib.ZSTD_getFrameContentSize.restype = ctypes.c_ulonglong
        lib.ZSTD_getFrameContentSize.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return lib


_LIB = _load()
_SESSION_ONLY = 1  # ZSTD_reset_session_only: forget the last frame, keep the parameters


class _Context:
    """One thread's decompression context, freed with the thread's local storage."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.ptr = lib, lib.ZSTD_createDCtx()
        if not self.ptr:
            raise MemoryError("ZSTD_createDCtx failed")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.ZSTD_freeDCtx(self.ptr)


def _context() -> _Context:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = _local.ctx = _Context(_LIB)
    return ctx


def decode_prefix(frame: bytes, out: np.ndarray) -> int:
    """Decompress the first `out.nbytes` bytes of the zstd content of `frame` into `out` (a
    C-contiguous array); returns how many bytes were written, fewer only when the content is
    shorter. ValueError when the frame is damaged before that point."""
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("decode_prefix needs a C-contiguous, writable output array")
    want = out.nbytes
    if want == 0:
        return 0
    if _LIB is None:
        whole = np.frombuffer(_FALLBACK.decode(frame), np.uint8)
        got = min(len(whole), want)
        out.reshape(-1).view(np.uint8)[:got] = whole[:got]
        return got
    ctx = _context()
    _LIB.ZSTD_DCtx_reset(ctx.ptr, _SESSION_ONLY)
    src = ctypes.c_char_p(frame)  # keeps the pointer valid for the calls below
    inb = _InBuffer(ctypes.cast(src, ctypes.c_void_p), len(frame), 0)
    outb = _OutBuffer(out.__array_interface__["data"][0], want, 0)  # cheaper than out.ctypes
    while outb.pos < want:
        before = (inb.pos, outb.pos)
        r = _LIB.ZSTD_decompressStream(ctx.ptr, ctypes.byref(outb), ctypes.byref(inb))
        if _LIB.ZSTD_isError(r):
            raise ValueError("zstd decompression error: invalid input data")
        if r == 0 or (inb.pos, outb.pos) == before:  # frame ended, or no progress: the content is shorter
            break
    return int(outb.pos)


_UNKNOWN_SIZE = 2**64 - 2  # ZSTD_CONTENTSIZE_ERROR; ZSTD_CONTENTSIZE_UNKNOWN is 2**64 - 1


def decode(frame: bytes) -> bytes:
    """The whole content of a zstd frame (as numcodecs decodes it), with the thread's context
    when the frame records its content size."""
    size = _LIB.ZSTD_getFrameContentSize(frame, len(frame)) if _LIB is not None else _UNKNOWN_SIZE
    if size >= _UNKNOWN_SIZE or size > 1 << 31:
        return bytes(_FALLBACK.decode(frame))
    out = np.empty(size, np.uint8)
    if decode_prefix(frame, out) != size:
        raise ValueError("zstd frame shorter than its recorded content size")
    return out.tobytes()
