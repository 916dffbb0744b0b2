"""Store maintenance behind `embedcache inspect | verify | import | export`.

`verify` re-reads every chunk and checks it against the `chunk_sha256` recorded at
finalisation; `import` turns features computed elsewhere (.npz, .h5, .mat) into a normal
complete shard; `export` writes one HDF5 group per shard, atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr

from embedcache import store as st
from embedcache.errors import UserError
from embedcache.manifest import canonical_json
from embedcache.reader import open_store

REQUIRED_ATTRS = ("cache_key", "backbone", "weights_sha256", "preprocess", "manifest_hash", "sample_list_hash",
                  "code_version", "dtype", "views", "n", "dim", "domain", "chunk_sha256", "complete")


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def inspect_store(path: str | Path) -> dict:
    """Shards with N, D, dtype, views, bytes on disk and completeness."""
    info = open_store(path)
    shards = [{"shard": s.path, "backbone": s.backbone, "client": s.client, "split": s.split, "domain": s.domain,
               "n": s.n, "dim": s.dim, "dtype": s.dtype, "views": s.views, "complete": s.complete,
               "bytes": _du(Path(path) / s.path)} for s in info.shards]
    return {"store": str(path), "classes": list(info.classes), "manifest_hash": info.manifest_hash,
            "backbones": list(info.backbones), "clients": list(info.clients), "shards": shards,
            "bytes": _du(Path(path)), "complete": all(s["complete"] for s in shards)}


def _shard_groups(path: Path) -> list[tuple[str, zarr.Group]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = zarr.open_group(str(path), mode="r", zarr_format=3, use_consolidated=False)
        out = []
        for bkey, bgroup in sorted(root.groups()):
            for client, cgroup in sorted(bgroup.groups()):
                for split, shard in sorted(cgroup.groups()):
                    out.append((f"{bkey}/{client}/{split}", shard))
        return out


def verify_shard(name: str, shard: zarr.Group, n_classes: int) -> list[str]:
    """Problems of one shard (empty list: complete and consistent)."""
    a = dict(shard.attrs)
    missing = [k for k in REQUIRED_ATTRS if k not in a]
    if missing:
        return [f"{name}: attributes missing: {', '.join(missing)}"]
    if a["complete"] is not True:
        return [f"{name}: not complete"]
    n, d, v = int(a["n"]), int(a["dim"]), int(a["views"])
    probs = []
    for arr, shape in (("features", (n, d)), ("labels", (n,)), ("sample_ids", (n,)), ("done", None)) + (
            (("views", (v, n, d)),) if v > 1 else ()):
        if arr not in shard:
            probs.append(f"{name}: array {arr} missing")
        elif shape is not None and shard[arr].shape != shape:
            probs.append(f"{name}: {arr} shape {shard[arr].shape} != {shape}")
    if probs:
        return probs
    labels = shard["labels"][...]
    if n and (labels.min() < 0 or labels.max() >= n_classes):
        probs.append(f"{name}: labels outside 0..{n_classes - 1}")
    if len(set(np.asarray(shard["sample_ids"][...]).tolist())) != n:
        probs.append(f"{name}: sample ids not unique")
    n_chunks = shard["done"].shape[0]
    if len(a["chunk_sha256"]) != n_chunks:
        return probs + [f"{name}: {len(a['chunk_sha256'])} chunk digests for {n_chunks} chunks"]
    for chunk, want in enumerate(a["chunk_sha256"]):
        if st.stored_chunk_digest(shard, chunk) != want:
            probs.append(f"{name}: chunk {chunk} sha256 mismatch")
    return probs


def verify_store(path: str | Path) -> list[str]:
    """Every problem found in the store; empty when every shard is complete and consistent."""
    info = open_store(path)  # raises UserError when it is not a store at all
    probs = []
    for name, shard in _shard_groups(Path(path)):
        probs += verify_shard(name, shard, len(info.classes))
    if not probs and not info.shards:
        probs.append(f"{path}: no shards")
    return probs


def _read_features(path: Path, features_key: str, labels_key: str, transpose: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    suffix = path.suffix.lower()
    ids = None
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                data = {k: z[k] for k in z.files}
        elif suffix in (".h5", ".hdf5"):
            import h5py

            with h5py.File(path, "r") as f:
                data = {k: f[k][()] for k in f.keys() if isinstance(f[k], h5py.Dataset)}
        elif suffix == ".mat":
            from scipy.io import loadmat

            data = {k: v for k, v in loadmat(str(path)).items() if not k.startswith("__")}
        else:
            raise UserError(f"{path}: unsupported file type {suffix!r} (use .npz, .h5 or .mat)")
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    for key in (features_key, labels_key):
        if key not in data:
            raise UserError(f"{path}: no array {key!r} (has: {', '.join(sorted(data))})")
    feats = np.asarray(data[features_key])
    if transpose:
        feats = feats.T
    labels = np.asarray(data[labels_key]).reshape(-1)
    if "sample_ids" in data:
        raw = np.asarray(data["sample_ids"]).reshape(-1)
        ids = np.array([x.decode() if isinstance(x, bytes) else str(x) for x in raw.tolist()], dtype=str)
    return feats, labels, ids


def import_features(store: str | Path, file: str | Path, *, backbone: str, client: str, split: str,
                    domain: str | None = None, features_key: str = "features", labels_key: str = "labels",
                    transpose: bool = False, classes: Sequence[str] | None = None, dtype: str = "float32",
                    chunk_rows: int = st.DEFAULT_CHUNK_ROWS) -> st.ShardSpec:
    """Write features computed elsewhere as a normal complete shard (weights_sha256 = file sha256)."""
    path = Path(file)
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    if not client or any(not (c.isascii() and (c.isalnum() or c in "_.-")) for c in client):
        raise UserError(f"client {client!r}: must match [A-Za-z0-9_.-]+")
    feats, labels, ids = _read_features(path, features_key, labels_key, transpose)
    if feats.ndim != 2 or not np.issubdtype(feats.dtype, np.number):
        raise UserError(f"{path}: {features_key} must be a numeric [N, D] array, got shape {feats.shape}")
    n, d = feats.shape
    if labels.shape != (n,):
        raise UserError(f"{path}: {labels_key} has {labels.size} entries for {n} feature rows (use --transpose for [D, N])")
    if not np.issubdtype(labels.dtype, np.number) or not np.all(labels == np.round(labels)):
        raise UserError(f"{path}: {labels_key} must be integer class indices")
    labels = labels.astype(np.int64)
    if ids is None:
        ids = np.array([f"{client}/{split}/{i:06d}" for i in range(n)], dtype=str)
    if ids.shape != (n,) or len(set(ids.tolist())) != n:
        raise UserError(f"{path}: sample_ids must be {n} unique strings")
    if not np.isfinite(feats).all():
        raise UserError(f"{path}: {features_key} contains NaN/inf")
    file_sha = hashlib.sha256(path.read_bytes()).hexdigest()
    existing = st.store_classes(store)
    if existing is None:
        cls = list(classes) if classes else [str(i) for i in range(int(labels.max()) + 1 if n else 0)]
        st.init_store(store, cls, file_sha)
    else:
        if classes and list(classes) != existing:
            raise UserError(f"--classes: differ from the store's classes {existing}")
        cls = existing
    if n and (labels.min() < 0 or labels.max() >= len(cls)):
        raise UserError(f"{path}: labels {labels.min()}..{labels.max()} outside the class list (0..{len(cls) - 1})")
    # The manifest's formula (sha256 of [source, [[id, locator, label], ...]]), the file as source.
    sample_list_hash = hashlib.sha256(canonical_json(
        [f"import:{path.name}", [[i, i, int(y)] for i, y in zip(ids.tolist(), labels.tolist())]]).encode()).hexdigest()
    spec = st.ShardSpec(
        backbone=backbone, weights_sha256=file_sha, preprocess={"imported_from": path.name}, feature_dim=d,
        client=client, split=split, domain=domain or client, manifest_hash=file_sha,
        sample_list_hash=sample_list_hash, sample_ids=tuple(ids.tolist()), labels=tuple(labels.tolist()),
        views=1, dtype=dtype, chunk_rows=chunk_rows)
    st.add_client(store, client)
    st.write_shard(store, spec, feats.astype(np.float32))
    st.consolidate(store)
    return spec


def _h5_attr(value: object) -> object:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return value


def export_h5(store: str | Path, out: str | Path) -> int:
    """One HDF5 group per complete shard (`<backbone key>/<client>/<split>`). Returns the count."""
    import h5py

    info = open_store(store)
    bad = [s.path for s in info.shards if not s.complete]
    if bad:
        raise UserError(f"{bad[0]}: shard incomplete; run extract (or verify) first")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update({"format": "embedcache/1", "classes": json.dumps(list(info.classes)),
                            "manifest_hash": info.manifest_hash})
            root = zarr.open_group(str(store), mode="r", zarr_format=3)
            for s in info.shards:
                src = root[s.path]
                g = f.create_group(s.path)
                for k, v in src.attrs.items():
                    g.attrs[k] = _h5_attr(v)
                g.create_dataset("features", data=src["features"][...])
                g.create_dataset("labels", data=src["labels"][...])
                ids = np.asarray(src["sample_ids"][...]).tolist()
                g.create_dataset("sample_ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
                if s.views > 1:
                    g.create_dataset("views", data=src["views"][...])
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return len(info.shards)
