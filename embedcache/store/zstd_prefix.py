"""zstd decompression of a frame's first bytes, into a caller's buffer, with one reused
decompression context per thread (python-zstandard; Zstandard, RFC 8878: a frame's blocks decode
in order, so a prefix of the content needs only the blocks that hold it).

Why: zarr stores a shard's last chunk whole (padded to the chunk rows), so a 1-row shard of
1280-d float32 at 256 rows per chunk is a 1.3 MB frame; the reader needs its first 5 kB. numcodecs
decodes whole frames and creates a context per call, which dominated stores of many tiny shards.
Bytes are never trusted here: the reader checks every chunk's rows against their sha256.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

_local = threading.local()


def _context() -> zstandard.ZstdDecompressor:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = _local.ctx = zstandard.ZstdDecompressor()
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
    dst = out.reshape(-1).view(np.uint8).data  # a writable memoryview of `out`
    got = 0
    try:
        with _context().stream_reader(frame, read_across_frames=False) as r:
            while got < want:
                n = r.readinto(dst[got:])
                if not n:  # the frame ended: the content is shorter
                    break
                got += n
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd decompression error: {exc}") from None
    return got


def decode(frame: bytes) -> bytes:
    """The whole content of a zstd frame (as numcodecs decodes it), with the thread's context.
    ValueError when the frame is damaged or does not record its content size."""
    try:
        return _context().decompress(frame)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd decompression error: {exc}") from None
