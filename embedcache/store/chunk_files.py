"""Whole stored chunks read straight from their files, for arrays in the layout the writer creates:
Zarr v3 (Zarr v3 core specification, "Chunk grids: regular", "Chunk key encoding: default",
codecs `bytes` or `vlen-utf8`, then an optional `zstd`), one chunk across every axis but the
row axis. zarr's own read of a chunk this small costs a round trip through its event loop and
per-call indexing, which dominates stores of many tiny shards; decoding the file here is a read,
a decompression and a `frombuffer`. Any other layout gives None and is read through zarr.

Nothing is trusted here: a chunk file that is absent reads as the fill value, as zarr reads it,
and the caller (`embedcache.store.checked_reads`) checks every chunk against its digests.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from numcodecs.vlen import VLenUTF8

from embedcache.store.zstd_prefix import decode, decode_prefix

_VLEN = VLenUTF8()
_NUMERIC = {"float32", "float16", "float64", "int64", "int32", "uint8", "bool"}


@dataclass(frozen=True)
class ChunkFiles:
    """One array's chunk files: `read(c0, c1)` gives its rows of row chunks [c0, c1)."""

    directory: str  # the array's directory
    shape: tuple[int, ...]  # the array's shape
    chunks: tuple[int, ...]  # the chunk shape (whole along every axis but the row axis)
    row_axis: int  # 0, or 1 for the views array [V, N, D]
    dtype: np.dtype | None  # stored dtype with its byte order; None: variable-length UTF-8 strings
    zstd: bool  # the chunk bytes are zstd-compressed
    separator: str  # of the chunk key ("/" or ".")
    fill: Any  # fill value of a chunk that has no file

    @classmethod
    def parse(cls, directory: str, meta: Any, row_axis: int = 0) -> ChunkFiles | None:
        """The array's chunk files when its metadata (zarr.json, parsed) is in the writer's
        layout; None when anything differs (zarr then reads it)."""
        try:
            if (not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array"
                    or meta.get("storage_transformers") not in (None, [])):
                return None
            grid, keys = meta["chunk_grid"], meta["chunk_key_encoding"]
            if grid.get("name") != "regular" or keys.get("name") != "default":
                return None
            shape = tuple(int(v) for v in meta["shape"])
            chunks = tuple(int(v) for v in grid["configuration"]["chunk_shape"])
            separator = (keys.get("configuration") or {}).get("separator", "/")
            if (len(shape) != len(chunks) or not 0 <= row_axis < len(shape) or separator not in ("/", ".")
                    or any(c != s for i, (c, s) in enumerate(zip(chunks, shape)) if i != row_axis)
                    or chunks[row_axis] < 1):
                return None
            codecs = [c if isinstance(c, dict) else {"name": c} for c in meta["codecs"]]
            names = [c.get("name") for c in codecs]
            zstd = names[1:] == ["zstd"]
            if names[1:] not in ([], ["zstd"]):
                return None
            kind, dtype = meta["data_type"], None
            if names[0] == "vlen-utf8" and kind == "string":
                fill = meta.get("fill_value") or ""
            elif names[0] == "bytes" and kind in _NUMERIC:
                endian = (codecs[0].get("configuration") or {}).get("endian", "little")
                if endian not in ("little", "big"):
                    return None
                dtype = np.dtype(kind).newbyteorder("<" if endian == "little" else ">")
                fill = np.array(meta.get("fill_value", 0) or 0).astype(dtype).item()
            else:
                return None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return cls(directory, shape, chunks, row_axis, dtype, zstd, separator, fill)

    def _key(self, chunk: int) -> str:
        idx = ["0"] * len(self.shape)
        idx[self.row_axis] = str(chunk)
        return f"{self.directory}{os.sep}c{self.separator}{self.separator.join(idx)}"

    def chunk(self, chunk: int, rows: int | None = None) -> np.ndarray:
        """The first `rows` rows of a stored chunk (all by default; edge chunks are stored whole);
        the fill value when its file is absent. Numeric chunks split along axis 0 decode only
        the bytes of those rows (`zstd_prefix`)."""
        cr = self.chunks[self.row_axis]
        rows = cr if rows is None else rows
        try:
            with open(self._key(chunk), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            shape = tuple(rows if i == self.row_axis else s for i, s in enumerate(self.chunks))
            return np.full(shape, self.fill, dtype=object if self.dtype is None else self.dtype)
        size = math.prod(self.chunks)
        if self.dtype is None:
            out = np.asarray(_VLEN.decode(decode(raw) if self.zstd else raw), dtype=object)
        else:  # decoded into a fresh array: callers get writable rows, as from zarr
            prefix = self.row_axis == 0 and rows < cr
            out = np.empty(size // cr * rows if prefix else size, dtype=self.dtype)
            if self.zstd:
                n = decode_prefix(raw, out)
            else:
                n = min(len(raw), out.nbytes)
                out.view(np.uint8)[:n] = np.frombuffer(raw, np.uint8)[:n]
            if n != out.nbytes or (not self.zstd and len(raw) != size * self.dtype.itemsize):
                raise ValueError(f"chunk {chunk} holds too few bytes ({n} of {out.nbytes} decoded)")
            if prefix:
                return out.reshape((rows,) + self.chunks[1:])
        if out.size != size:
            raise ValueError(f"chunk {chunk} holds {out.size} values, not {size}")
        out = out.reshape(self.chunks)
        return out if rows == cr else out[(slice(None),) * self.row_axis + (slice(0, rows),)]

    def read(self, c0: int, c1: int) -> np.ndarray:
        """Rows [c0 * chunk_rows, min(c1 * chunk_rows, rows)) along the row axis."""
        cr, n = self.chunks[self.row_axis], self.shape[self.row_axis]
        parts = [self.chunk(c, max(0, min(cr, n - c * cr))) for c in range(c0, c1)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return np.empty(tuple(0 if i == self.row_axis else s for i, s in enumerate(self.shape)),
                            dtype=object if self.dtype is None else self.dtype)
        return np.concatenate(parts, axis=self.row_axis)
