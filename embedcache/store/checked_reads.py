"""Checked reads of one shard (docs/contracts.md, section 4): nothing is handed out that was
not written and checked. zarr reads a deleted chunk file as fill values, so every stored chunk
read is hashed (the bytes just read, no second read; on every core, sha256 releases the GIL)
and compared with the digests recorded when the shard was finalised. The digests are defined
here, beside the check, and the writer (`embedcache.store.writer`) imports them. numpy + zarr only.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import zarr

from embedcache.errors import UserError
from embedcache.store.chunk_files import ChunkFiles
from embedcache.store.layout import array, read

if TYPE_CHECKING:
    from embedcache.store.layout import ShardInfo, StoreNodes


def chunk_digest(key: str, features: np.ndarray, views: np.ndarray | None, mask: np.ndarray | None = None) -> bytes:
    """sha256 of (cache key, chunk features bytes, chunk views bytes, chunk mask bytes), C order,
    stored dtype, one byte per mask entry; a shard without views/mask hashes exactly as before."""
    h = hashlib.sha256(key.encode())
    h.update(_bytes(features))
    if views is not None:
        h.update(_bytes(views))
    if mask is not None:
        h.update(_bytes(np.ascontiguousarray(mask, dtype=np.bool_).view(np.uint8)))
    return h.digest()


def rows_digest(key: str, labels: np.ndarray, sample_ids: Sequence[str]) -> bytes:
    """sha256 of (cache key, labels as int64 bytes, compact JSON list of the sample ids)."""
    h = hashlib.sha256(key.encode())
    h.update(_bytes(np.asarray(labels, dtype=np.int64)))
    h.update(json.dumps([str(s) for s in sample_ids], ensure_ascii=False, separators=(",", ":")).encode())
    return h.digest()


def _bytes(arr: np.ndarray) -> memoryview:
    """The array's bytes in C order, without a copy when it is already contiguous."""
    return np.ascontiguousarray(arr).data.cast("B")


class Rows(NamedTuple):
    """Checked rows of a shard."""

    features: np.ndarray  # [n, D] float32
    labels: np.ndarray  # [n] int64
    ids: np.ndarray  # [n] str
    views: np.ndarray | None  # [V, n, D] float32 when asked for
    mask: np.ndarray | None  # [n, T] bool when the shard has a mask (text token shards)


def _str_ids(arr: object) -> np.ndarray:
    """zarr's variable-length strings as a plain numpy str array."""
    return np.array(np.asarray(arr).tolist(), dtype=str).reshape(-1)


_WORKERS = min(os.cpu_count() or 1, 8)


class ShardReader:
    """Reads whole stored chunks of one shard and checks each against the digests recorded at
    finalisation before any of its rows is handed out (hashing the bytes just read). Arrays in
    the writer's layout are read from their chunk files (`chunk_files`), others through zarr."""

    def __init__(self, nodes: StoreNodes, info: ShardInfo, views: bool) -> None:
        if views and info.views <= 1:
            raise UserError(f"{info.path}: no augmented views stored (extract with --views V > 1)")
        self.info, self.store, self.nodes = info, nodes.path, nodes
        a = nodes.attributes(info.path)
        if a is None:
            raise UserError(f"{info.path}: cannot read its metadata; run `embedcache verify {self.store}`")
        self.key, self.views = str(a.get("cache_key")), views
        self.has_mask = a.get("token_shape") is not None  # the mask is part of every chunk digest
        # A views shard read without its views is checked with features_sha256; older shards
        # lack it, so their views are read (and dropped) to check chunk_sha256.
        self.read_views = info.views > 1 and (views or "features_sha256" not in a)
        digests = a.get("chunk_sha256") if (info.views <= 1 or self.read_views) else a.get("features_sha256")
        rows_digests = a.get("rows_sha256")
        names = ["features", "labels", "sample_ids", *(["views"] if self.read_views else []),
                 *(["mask"] if self.has_mask else [])]
        files = {n: ChunkFiles.parse(os.path.join(self.store, info.path, n), nodes.get(f"{info.path}/{n}"),
                                     1 if n == "views" else 0) for n in names}
        self.files: dict[str, ChunkFiles] | None = None
        self.group: zarr.Group | None = None
        if all(f is not None for f in files.values()):
            self.files = {n: f for n, f in files.items() if f is not None}
            self.chunk_rows = self.files["features"].chunks[0]
        else:
            try:
                self.group = _group(nodes.root(), info.path)
                self.chunk_rows = int(array(self.group, "features").chunks[0])
            except Exception as exc:
                raise UserError(f"{info.path}: cannot read ({type(exc).__name__}: {exc}); "
                                f"run `embedcache verify {self.store}`") from None
        self.n_chunks = -(-info.n // self.chunk_rows)
        if (not isinstance(digests, list) or len(digests) != self.n_chunks
                or (rows_digests is not None and (not isinstance(rows_digests, list)
                                                  or len(rows_digests) != self.n_chunks))):
            raise UserError(f"{info.path}: chunk digests missing or malformed; run `embedcache verify {self.store}`")
        self.digests: list[str] = [str(d) for d in digests]
        self.rows_digests: list[str] | None = None if rows_digests is None else [str(d) for d in rows_digests]

    def _damaged(self, chunk: int) -> UserError:
        return UserError(f"{self.info.path} chunk {chunk}: data missing or changed since it was written; "
                         f"`embedcache verify {self.store}` lists the damage, `embedcache rm` removes the shard "
                         "to extract (or import) it again")

    def _rows(self, name: str, c0: int, c1: int) -> np.ndarray:
        """Rows of chunks [c0, c1) of one array (views: along its second axis)."""
        if self.files is not None:
            return self.files[name].read(c0, c1)
        assert self.group is not None
        a, b = c0 * self.chunk_rows, min(c1 * self.chunk_rows, self.info.n)
        return read(self.group, name, (slice(None), slice(a, b)) if name == "views" else slice(a, b))

    def read(self, c0: int, c1: int) -> Rows:
        """Rows of stored chunks [c0, c1), each chunk checked against its digests."""
        cr, info = self.chunk_rows, self.info
        a, b = c0 * cr, min(c1 * cr, info.n)
        try:
            raw = self._rows("features", c0, c1)
            labels = np.asarray(self._rows("labels", c0, c1), dtype=np.int64)
            ids = _str_ids(self._rows("sample_ids", c0, c1))
            rv = self._rows("views", c0, c1) if self.read_views else None
            mask = np.asarray(self._rows("mask", c0, c1), dtype=np.bool_) if self.has_mask else None
        except Exception as exc:  # a damaged chunk file fails to decode
            raise UserError(f"{info.path}: cannot read rows {a}..{b - 1} ({type(exc).__name__}: {exc}); "
                            f"run `embedcache verify {self.store}`") from None
        if raw.shape != (b - a, info.dim) or labels.shape != (b - a,) or ids.shape != (b - a,) or (
                mask is not None and mask.shape[0] != b - a) or (rv is not None and rv.shape[1:] != (b - a, info.dim)):
            raise UserError(f"{info.path}: arrays do not match n={info.n}, dim={info.dim}")
        if not np.isfinite(raw).all() or (self.views and rv is not None and not np.isfinite(rv).all()):
            raise UserError(f"{info.path}: features contain NaN/inf (rows {a}..{b - 1})")

        def intact(c: int) -> bool:
            s, e = c * cr - a, min((c + 1) * cr, info.n) - a
            if chunk_digest(self.key, raw[s:e], None if rv is None else rv[:, s:e],
                            None if mask is None else mask[s:e]).hex() != self.digests[c]:
                return False
            return (self.rows_digests is None
                    or rows_digest(self.key, labels[s:e], ids[s:e].tolist()).hex() == self.rows_digests[c])

        chunks = range(c0, c1)
        workers = min(_WORKERS, len(chunks) // 4)
        if workers > 1:  # sha256 releases the GIL: hash the chunks on every core
            with ThreadPoolExecutor(workers, thread_name_prefix="embedcache-digest") as pool:
                ok = list(pool.map(intact, chunks))
        else:
            ok = [intact(c) for c in chunks]
        if not all(ok):
            raise self._damaged(chunks[ok.index(False)])
        vws = np.asarray(rv, dtype=np.float32) if self.views else None
        return Rows(np.asarray(raw, dtype=np.float32), labels, ids, vws, mask)


def _group(root: zarr.Group, path: str) -> zarr.Group:
    found = root[path]
    if not isinstance(found, zarr.Group):
        raise UserError(f"{path}: an array where a shard group was expected")
    return found


class RowStream:
    """Sequential row ranges of one shard, read in whole checked chunks; rows read past the
    range asked are kept for the next range, so no chunk is read twice."""

    def __init__(self, reader: ShardReader) -> None:
        self.reader, self.next_chunk, self.start = reader, 0, 0
        self.buf: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def take(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows [a, b) as (features, labels, sample ids); ranges must follow each other."""
        have = self.start + (0 if self.buf is None else len(self.buf[1]))
        if have < b or self.buf is None:
            c1 = -(-b // self.reader.chunk_rows)
            f, y, s, _, _ = self.reader.read(self.next_chunk, c1)
            self.next_chunk = c1
            if self.buf is not None:
                f, y, s = (np.concatenate([self.buf[0], f]), np.concatenate([self.buf[1], y]),
                           np.concatenate([self.buf[2], s]))
            self.buf = (f, y, s)
        i, j = a - self.start, b - self.start
        f, y, s = self.buf
        self.buf, self.start = (f[j:], y[j:], s[j:]), b
        return f[i:j], y[i:j], s[i:j]
