"""`embedcache export`: every complete shard of a store, rows exactly as stored, to one HDF5 file
(`--format h5`) or to a directory of .npz files (`--format npz`); `embedcache import` reads both
back (docs/contracts.md, section 4a). Both are written under a temp name and renamed, so a failed
export never leaves a file that looks complete."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from embedcache.errors import UserError
from embedcache.store.checked_reads import ShardReader
from embedcache.store.reader import open_store

EXPORT_FORMAT = "embedcache-export/1"
EXPORT_FORMATS = ("h5", "npz")
EXPORT_INDEX = "export.json"  # the npz directory's index: format, classes, manifest_hash, shards' attrs


def _json_attrs(attrs: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dict(attrs)))  # zarr attrs -> plain JSON values


def _shards(store: str | Path) -> tuple[Any, Iterator[tuple[str, dict[str, Any], dict[str, np.ndarray]]]]:
    """The store's info and, one shard at a time, (path, attrs, arrays) with every row checked
    against its recorded digests on the way out (features/views in the stored dtype)."""
    info = open_store(store)
    bad = [s.path for s in info.shards if not s.complete]
    if bad:
        raise UserError(f"{bad[0]}: shard incomplete; run extract (or verify) first")

    def gen() -> Iterator[tuple[str, dict[str, Any], dict[str, np.ndarray]]]:
        nodes = info.nodes()
        for s in info.shards:
            reader = ShardReader(nodes, s, s.views > 1)  # exports only checked rows
            feats, labels, ids, views, mask = reader.read(0, reader.n_chunks)
            arrays = {"features": feats.astype(s.dtype), "labels": np.asarray(labels, np.int64),
                      "sample_ids": np.asarray(ids.tolist(), dtype=str)}
            if views is not None:
                arrays["views"] = views.astype(s.dtype)
            if mask is not None:
                arrays["mask"] = mask
            yield s.path, _json_attrs(nodes.attributes(s.path) or {}), arrays

    return info, gen()


def _h5_attr(value: object) -> object:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return value


def _write_h5(tmp: Path, info: Any, shards: Iterator) -> int:
    import h5py

    n = 0
    with h5py.File(tmp, "w") as f:
        f.attrs.update({"format": EXPORT_FORMAT, "classes": json.dumps(list(info.classes)),
                        "manifest_hash": info.manifest_hash})
        for path, attrs, arrays in shards:
            g = f.create_group(path)
            for k, v in attrs.items():
                g.attrs[k] = _h5_attr(v)
            for k, a in arrays.items():
                if k == "sample_ids":
                    g.create_dataset(k, data=np.array(a.tolist(), dtype=object), dtype=h5py.string_dtype())
                else:
                    g.create_dataset(k, data=a)
            n += 1
    return n


def _write_npz(tmp: Path, info: Any, shards: Iterator) -> int:
    tmp.mkdir(parents=True)
    index: dict[str, Any] = {"format": EXPORT_FORMAT, "classes": list(info.classes),
                             "manifest_hash": info.manifest_hash, "shards": {}}
    for path, attrs, arrays in shards:
        f = tmp / f"{path}.npz"
        f.parent.mkdir(parents=True, exist_ok=True)
        np.savez(f, **arrays)
        index["shards"][path] = attrs
    (tmp / EXPORT_INDEX).write_text(json.dumps(index, indent=1, sort_keys=True))
    return len(index["shards"])


def export_store(store: str | Path, out: str | Path, fmt: str = "h5") -> int:
    """Write every shard of `store` to `out` (an .h5 file, or a directory for npz). Returns the count."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"format {fmt}: must be one of {', '.join(EXPORT_FORMATS)}")
    out = Path(out)
    if fmt == "npz" and out.exists() and not (out.is_dir() and (out / EXPORT_INDEX).is_file()):
        raise UserError(f"--out {out}: exists and is not an npz export (refusing to replace it)")
    if fmt == "h5" and out.is_dir():
        raise UserError(f"--out {out}: is a directory (h5 writes one file)")
    info, shards = _shards(store)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    try:
        n = (_write_h5 if fmt == "h5" else _write_npz)(tmp, info, shards)
        if fmt == "npz" and out.exists():  # a directory cannot be replaced in one rename
            os.rename(out, old)
        os.replace(tmp, out)
    finally:
        for p in (tmp, old):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
    return n


def export_h5(store: str | Path, out: str | Path) -> int:
    """One HDF5 group per complete shard (`<backbone key>/<client>/<split>`). Returns the count."""
    return export_store(store, out, "h5")
