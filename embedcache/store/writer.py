"""Writer side of the Zarr v3 feature store (docs/contracts.md, section 4).

One shard per (backbone, client, split) holds the pooled features r_k(x) of one frozen
backbone; the reader concatenates the K backbones' shards column-wise, which is FedPCL's
r(x; Phi*) = concat(r_1(x; phi_1*), ..., r_K(x; phi_K*)) (Tan et al., NeurIPS 2022, Eq. 1-2).

Life of a shard, built so that nothing half-written can ever look complete:
1. `prepare_shard` (under a per-client fcntl lock) creates the group, its arrays, the
   manifest-derived `labels`/`sample_ids` and every attribute except `chunk_sha256` and
   `complete`; a shard whose `cache_key` differs is deleted and rebuilt, never served.
2. Anyone (this process, threads, dask workers) calls `write_chunk` for chunk-aligned row
   ranges. After the data it writes the chunk's digest into the small `done` array
   (one zarr chunk per data chunk, each written atomically by zarr's LocalStore), so a
   killed run resumes only the chunks whose digest is missing. Writes are idempotent.
3. `finalize_shard` (under the lock) re-reads every chunk, recomputes its sha256, compares it
   with `done`, then writes `chunk_sha256`, `rows_sha256` (labels and sample ids),
   `features_sha256` (views shards) and, last, `complete=True`. The reader checks every chunk
   it reads against these digests.
4. `consolidate` writes the consolidated metadata once at the end (under a store lock). Any
   change first drops it (`embedcache.store.layout.drop_consolidated`), so it never describes the store's past.

Chunk digests are salted with the cache key so that a digest written for other settings can
never validate a chunk of this shard. Names are unique under str.casefold() within a store
(contract 4): `Caltech10` and `caltech10` would share a directory on a case-insensitive file
system, and zarr's consolidated metadata cannot nest both.
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from embedcache.errors import UserError
from embedcache.manifest import canonical_json
from embedcache.store.checked_reads import chunk_digest, rows_digest
from embedcache.store.layout import (  # noqa: F401 (step 4 of a shard's life, called through the writer)
    REBUILD,
    SPLITS,
    STORE_FORMAT,
    OpenMode,
    array,
    attr,
    backbone_key,
    case_collision,
    check_backbone_name,
    check_client_names,
    collides,
    consolidate,
    dir_lock,
    folded,
    has_consolidated,
    holds_shards,
    read,
    root_metadata,
    shard_path,
    subgroups,
)
from embedcache.store.layout import drop_consolidated as _drop_consolidated
from embedcache.store.layout import quiet_open as _quiet_open
from embedcache.version import __version__

DEFAULT_CHUNK_ROWS = 256
# float32 is the default on purpose: FedNCM must equal centralised NCM to 1e-6 and two runs
# must give bitwise-identical stores. float16 halves the disk but keeps ~3 significant digits
# (relative error ~5e-4) and overflows to inf above 65504, which unnormalised features can reach.
DTYPES = ("float32", "float16")
_DIGEST = 32  # bytes in a sha256 digest


def cache_key(
    backbone: str, weights_sha256: str, preprocess: dict, sample_list_hash: str, views: int, dtype: str
) -> str:
    """sha256 over (backbone, weights_sha256, preprocess, sample_list_hash, views, dtype) (contract 4)."""
    payload = {
        "backbone": backbone,
        "weights_sha256": weights_sha256,
        "preprocess": preprocess,
        "sample_list_hash": sample_list_hash,
        "views": int(views),
        "dtype": dtype,
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


@dataclass(frozen=True)
class ShardSpec:
    """Everything that defines one shard before any feature is computed."""

    backbone: str  # backbone name as given by the user, e.g. "resnet20-cifar10"
    weights_sha256: str  # sha256 of the weights (or of the imported file)
    preprocess: dict  # the backbone's complete, JSON-able preprocessing description
    feature_dim: int  # D, the pooled dimension the backbone actually produces
    client: str  # client name (filesystem-safe)
    split: str  # "train" or "test"
    domain: str  # the client's domain
    manifest_hash: str  # content hash of the manifest the samples come from
    sample_list_hash: str  # manifest.sample_list_hash(client, split)
    sample_ids: tuple[str, ...] = field(repr=False)  # row order of the shard
    labels: tuple[int, ...] = field(repr=False)  # one class index per row
    views: int = 1  # V; a `views` array [V, N, D] exists only when V > 1
    dtype: str = "float32"  # storage dtype of features/views (see DTYPES)
    chunk_rows: int = DEFAULT_CHUNK_ROWS  # rows per zarr chunk and per extraction task
    batch_size: int = 64  # rows per forward pass; recorded so a resumed run batches the same way
    modality: str = "image"  # the backbone's: "image" | "text"
    token_shape: tuple[int, int] | None = None  # (T, D_tok) of text token states: rows T-major + a `mask` [N, T]

    @property
    def n(self) -> int:
        return len(self.sample_ids)

    @property
    def n_chunks(self) -> int:
        return -(-self.n // self.chunk_rows)

    @property
    def key(self) -> str:
        return cache_key(
            self.backbone, self.weights_sha256, self.preprocess, self.sample_list_hash, self.views, self.dtype
        )

    def rows(self, chunk: int) -> tuple[int, int]:
        """Half-open row range [start, stop) of chunk `chunk`."""
        start = chunk * self.chunk_rows
        return start, min(start + self.chunk_rows, self.n)


def _check_root(store: Path, root: zarr.Group, classes: Sequence[str] | None) -> None:
    if attr(root, "format") != STORE_FORMAT:
        raise UserError(f"{store}: not an embedcache store (format={attr(root, 'format')!r})")
    old = list(attr(root, "classes", []))
    if classes is not None and old != list(classes):
        raise UserError(f"{store}: store classes {old} differ from {list(classes)}; use a new store")


def init_store(store: str | Path, classes: Sequence[str], manifest_hash: str,
               clients: Sequence[str] | None = None, source: str | None = None) -> None:
    """Create the store root (or check an existing one): the class list must not change,
    since every label in every shard indexes it. `clients` (an extraction's manifest clients)
    becomes the store's client list, so shards of clients that a later manifest dropped stay on
    disk but are no longer served by the reader (they would leak old samples into training).
    Under the same manifest, clients added by `import` stay listed. `source` (the manifest's
    source) names the data in titles; None leaves it as it is."""
    store = Path(store)
    if clients is not None:
        check_client_names(store, clients)  # before dir_lock creates the directory
    with dir_lock(store):
        if (store / "zarr.json").exists():
            root_metadata(store)  # a damaged root is one line saying how to rebuild it, not zarr's parse error
            root = _quiet_open(store, "r+", use_consolidated=False)
            _check_root(store, root, classes)
            listed = attr(root, "clients")
            if clients is not None and listed is not None and attr(root, "manifest_hash") == manifest_hash:
                clients = [*clients, *(c for c in listed if c not in clients)]
            if attr(root, "manifest_hash") != manifest_hash:
                _drop_consolidated(store, have_lock=True)
                root.attrs["manifest_hash"] = manifest_hash
            if clients is not None and list(listed or []) != list(clients):
                _drop_consolidated(store, have_lock=True)
                root.attrs["clients"] = list(clients)
            if source is not None and attr(root, "source") != source:
                _drop_consolidated(store, have_lock=True)
                root.attrs["source"] = source
            return
        if holds_shards(store):  # a store that lost its root metadata
            raise UserError(f"{store / 'zarr.json'}: missing; {REBUILD.format(store=store)}")
        if any(p.name != "zarr.json" for p in store.iterdir()):
            # Never take over (or wipe) a directory that holds something else.
            raise UserError(f"{store}: directory is not empty and is not an embedcache store")
        root = _quiet_open(store, "w-")
        root.attrs.update({"format": STORE_FORMAT, "classes": list(classes), "manifest_hash": manifest_hash})
        if clients is not None:
            root.attrs["clients"] = list(clients)
        if source is not None:
            root.attrs["source"] = source


def add_clients(store: str | Path, clients: Sequence[str]) -> None:
    """Make imported clients part of a store that keeps a client list (no-op otherwise), in one
    write of the root's metadata however many they are."""
    with dir_lock(store):
        root = _quiet_open(store, "r+", use_consolidated=False)
        listed = attr(root, "clients")
        if listed is None:
            return
        known, have = folded(listed), set(listed)
        new = [c for c in dict.fromkeys(clients) if c not in have]
        for c in new:
            other = next((o for o in known.get(c.casefold(), ()) if o != c), None)
            if other is not None:
                raise collides("client", c, other)
        if new:
            _drop_consolidated(store, have_lock=True)
            root.attrs["clients"] = [*listed, *new]


def store_root(store: str | Path) -> dict | None:
    """The root attributes of an existing embedcache store, or None when there is no store yet."""
    if not (Path(store) / "zarr.json").exists():
        return None
    attrs = root_metadata(store)["attributes"]
    if attrs.get("format") != STORE_FORMAT:
        raise UserError(f"{store}: not an embedcache store (format={attrs.get('format')!r})")
    return dict(attrs)


def _shard_attrs(spec: ShardSpec) -> dict:
    return {
        "cache_key": spec.key,
        "backbone": spec.backbone,
        "weights_sha256": spec.weights_sha256,
        "preprocess": spec.preprocess,
        "manifest_hash": spec.manifest_hash,
        "sample_list_hash": spec.sample_list_hash,
        "code_version": __version__,
        "dtype": spec.dtype,
        "views": spec.views,
        "n": spec.n,
        "dim": spec.feature_dim,
        "domain": spec.domain,
        "batch_size": spec.batch_size,
        "modality": spec.modality,
        **({"token_shape": list(spec.token_shape)} if spec.token_shape is not None else {}),
    }


def _matches(shard: zarr.Group, spec: ShardSpec) -> bool:
    try:
        feats = array(shard, "features")
        done = array(shard, "done")
        mask_ok = spec.token_shape is None or array(shard, "mask").shape == (spec.n, spec.token_shape[0])
    except (KeyError, UserError):  # missing, or a group where an array belongs: not resumable
        return False
    return (
        attr(shard, "cache_key") == spec.key
        and feats.shape == (spec.n, spec.feature_dim)
        and feats.chunks[0] == spec.chunk_rows
        and done.shape == (spec.n_chunks, _DIGEST)
        and mask_ok
    )


def check_feature_dim(store: str | Path, spec: ShardSpec) -> None:
    """Every client of one backbone must share D, or the clients' features would not stack
    for the heads: refuse a shard whose D differs from the backbone's other shards."""
    bdir = Path(store) / backbone_key(spec.backbone)
    if not (bdir / "zarr.json").is_file():
        return
    old_dim = root_metadata(bdir)["attributes"].get("feature_dim")
    if old_dim is None or old_dim == spec.feature_dim:
        return
    others = [f"{c}/{s}" for c in subgroups(bdir) for s in subgroups(bdir / c) if (c, s) != (spec.client, spec.split)]
    if others:
        raise UserError(f"{spec.backbone}: feature dim {spec.feature_dim} differs from dim {old_dim} of its "
                        f"shards already in the store (e.g. {others[0]}); use another name or store")


def prepare_shard(store: str | Path, spec: ShardSpec, *, names_checked: bool = False) -> bool:
    """Create the shard for `spec` unless a matching one exists. Returns True when the shard
    is already complete (a cache hit: nothing to compute, no image to touch). `names_checked`:
    the caller checked the backbone and client names of its whole batch (check_backbone_name,
    check_client_names) just before, which per shard would list every client again."""
    if spec.dtype not in DTYPES:
        raise UserError(f"dtype {spec.dtype}: must be one of {', '.join(DTYPES)}")
    if spec.split not in SPLITS:
        raise UserError(f"split {spec.split}: must be train or test")
    if spec.token_shape is not None and (spec.views > 1 or spec.token_shape[0] * spec.token_shape[1] != spec.feature_dim):
        raise UserError(f"{spec.backbone}: token shards hold no views and T*D must equal the feature dim "
                        f"(token_shape {list(spec.token_shape)}, dim {spec.feature_dim}, views {spec.views})")
    store = Path(store)
    bk = backbone_key(spec.backbone)
    if not names_checked:
        check_backbone_name(store, spec.backbone)
        check_client_names(store, [spec.client])
    client_dir = store / bk / spec.client
    with dir_lock(client_dir):
        root = _quiet_open(store, "r+", use_consolidated=False)
        check_feature_dim(store, spec)
        bgroup = root.require_group(bk)
        battrs: dict[str, Any] = {"backbone": spec.backbone, "weights_sha256": spec.weights_sha256,
                  "preprocess": spec.preprocess, "feature_dim": spec.feature_dim}
        if dict(bgroup.attrs) != battrs:
            _drop_consolidated(store)
            bgroup.attrs.update(battrs)
        cgroup = bgroup.require_group(spec.client)
        if attr(cgroup, "domain") != spec.domain:
            _drop_consolidated(store)
            cgroup.attrs["domain"] = spec.domain
        if spec.split in cgroup:
            shard = cgroup[spec.split]
            if isinstance(shard, zarr.Group) and _matches(shard, spec):
                # a cache hit under a new manifest: the features stand, the provenance moves on
                # (neither attribute is in the cache key or the chunk digests)
                fresh = {"domain": spec.domain, "manifest_hash": spec.manifest_hash}
                if any(attr(shard, k) != v for k, v in fresh.items()):
                    _drop_consolidated(store)
                    shard.attrs.update(fresh)
                return bool(attr(shard, "complete", False))
        _drop_consolidated(store)
        shutil.rmtree(client_dir / spec.split, ignore_errors=True)
        _create(cgroup, spec)
        return False


def _create(cgroup: zarr.Group, spec: ShardSpec) -> None:
    n, d, cr = spec.n, spec.feature_dim, spec.chunk_rows
    shard = cgroup.create_group(spec.split)
    shard.create_array("features", shape=(n, d), chunks=(cr, d), dtype=spec.dtype, fill_value=0)
    if spec.views > 1:
        shard.create_array("views", shape=(spec.views, n, d), chunks=(spec.views, cr, d),
                           dtype=spec.dtype, fill_value=0)
    if spec.token_shape is not None:
        t = spec.token_shape[0]
        shard.create_array("mask", shape=(n, t), chunks=(cr, t), dtype="bool", fill_value=False)
    labels = shard.create_array("labels", shape=(n,), chunks=(max(cr, 1),), dtype="int64", fill_value=0)
    ids = shard.create_array("sample_ids", shape=(n,), chunks=(max(cr, 1),), dtype=str)
    shard.create_array("done", shape=(spec.n_chunks, _DIGEST), chunks=(1, _DIGEST), dtype="uint8", fill_value=0)
    if n:
        labels[:] = np.asarray(spec.labels, dtype=np.int64)
        ids[:] = np.asarray(spec.sample_ids, dtype=str)
    # Attributes last: a shard with no cache_key is never mistaken for a resumable one.
    shard.attrs.update(_shard_attrs(spec))


def open_shard(store: str | Path, backbone: str, client: str, split: str, mode: OpenMode = "r+") -> zarr.Group:
    """The shard group, opened through the root so that its `.path` names it in messages."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = _quiet_open(store, mode, use_consolidated=False)
        try:
            shard = root[shard_path(store, backbone, client, split)]
        except KeyError:
            raise UserError(f"{shard_path(store, backbone, client, split)}: no such shard in {store}") from None
    if not isinstance(shard, zarr.Group):
        raise UserError(f"{shard_path(store, backbone, client, split)}: an array where a shard group was expected")
    return shard


def missing_chunks(shard: zarr.Group) -> list[int]:
    """Chunks whose digest has not been recorded yet (all-zero row in `done`)."""
    done = read(shard, "done")
    return [int(i) for i in np.flatnonzero(~done.any(axis=1))]


def write_chunk(
    shard: zarr.Group, chunk: int, features: np.ndarray, views: np.ndarray | None = None,
    mask: np.ndarray | None = None,
) -> None:
    """Write the features (and views, or the token mask of a token shard) of one chunk, then its
    digest. Idempotent."""
    attrs: dict[str, Any] = dict(shard.attrs)
    start = chunk * array(shard, "features").chunks[0]
    stop = start + features.shape[0]
    dtype = np.dtype(attrs["dtype"])
    if features.shape != (stop - start, attrs["dim"]) or stop > attrs["n"]:
        raise UserError(f"chunk {chunk}: features shape {features.shape} does not fit shard "
                        f"[{attrs['n']}, {attrs['dim']}] rows {start}:{stop}")
    with np.errstate(over="ignore"):  # float16 overflow becomes inf and is refused just below
        feats = features.astype(dtype, copy=False)
    if not np.isfinite(feats).all():
        raise UserError(f"chunk {chunk} of {attrs['backbone']}: features contain NaN/inf "
                        f"(rows {start}:{stop}{', float16 overflow?' if dtype == np.float16 else ''})")
    array(shard, "features")[start:stop] = feats
    vws = None
    if attrs["views"] > 1:
        if views is None or views.shape != (attrs["views"], stop - start, attrs["dim"]):
            raise UserError(f"chunk {chunk}: views shape {None if views is None else views.shape} "
                            f"!= ({attrs['views']}, {stop - start}, {attrs['dim']})")
        with np.errstate(over="ignore"):
            vws = views.astype(dtype, copy=False)
        if not np.isfinite(vws).all():
            raise UserError(f"chunk {chunk} of {attrs['backbone']}: views contain NaN/inf")
        array(shard, "views")[:, start:stop] = vws
    msk = None
    if attrs.get("token_shape") is not None:
        t = int(attrs["token_shape"][0])
        if mask is None or mask.shape != (stop - start, t):
            raise UserError(f"chunk {chunk}: mask shape {None if mask is None else mask.shape} != ({stop - start}, {t})")
        msk = np.asarray(mask, dtype=np.bool_)
        array(shard, "mask")[start:stop] = msk
    elif mask is not None:
        raise UserError(f"chunk {chunk} of {attrs['backbone']}: a mask was given to a shard without token_shape")
    digest = chunk_digest(attrs["cache_key"], feats, vws, msk)
    array(shard, "done")[chunk] = np.frombuffer(digest, dtype=np.uint8)


@dataclass(frozen=True)
class StoredDigests:
    """A chunk's digests recomputed from what is on disk (hex)."""

    chunk: str  # chunk_sha256: features and views
    features: str  # features_sha256: features alone
    rows: str  # rows_sha256: labels and sample ids


def stored_digests(shard: zarr.Group, chunk: int) -> StoredDigests:
    """Recompute every digest of one chunk from what is on disk (one read of each array)."""
    cr = array(shard, "features").chunks[0]
    attrs: dict[str, Any] = dict(shard.attrs)
    key = attrs["cache_key"]
    start, stop = chunk * cr, min((chunk + 1) * cr, attrs["n"])
    rows = slice(start, stop)
    feats = read(shard, "features", rows)
    vws = read(shard, "views", (slice(None), rows)) if "views" in shard else None
    msk = read(shard, "mask", rows) if attr(shard, "token_shape") is not None else None
    ids = read(shard, "sample_ids", rows).tolist()
    features = chunk_digest(key, feats, None, msk).hex()
    return StoredDigests(features if vws is None else chunk_digest(key, feats, vws, msk).hex(), features,
                         rows_digest(key, read(shard, "labels", rows), ids).hex())


def finalize_shard(store: str | Path, spec: ShardSpec) -> None:
    """Re-read every chunk, check its sha256 against `done`, then write `chunk_sha256` and,
    last of all, `complete`."""
    store = Path(store)
    with dir_lock(store / backbone_key(spec.backbone) / spec.client):
        shard = open_shard(store, spec.backbone, spec.client, spec.split)
        if attr(shard, "cache_key") != spec.key:
            raise UserError(f"{shard_path(store, spec.backbone, spec.client, spec.split)}: replaced by a "
                            "concurrent extract with other settings; run extract again")
        if attr(shard, "complete"):
            return
        done = read(shard, "done")
        digests, feature_digests, row_digests = [], [], []
        for chunk in range(spec.n_chunks):
            want = bytes(done[chunk]).hex()
            got = stored_digests(shard, chunk)
            if got.chunk != want:
                # A digest that is missing or disagrees with the data: the chunk is not done.
                array(shard, "done")[chunk] = np.zeros(_DIGEST, dtype=np.uint8)
                raise UserError(f"{shard.path} chunk {chunk}: sha256 of the stored data does not match "
                                "its record; run extract again to rewrite it")
            a, b = spec.rows(chunk)
            if got.rows != rows_digest(spec.key, np.asarray(spec.labels[a:b]), spec.sample_ids[a:b]).hex():
                # labels/sample ids are written once, at creation: lost ones need a new shard
                raise UserError(f"{shard.path} chunk {chunk}: stored labels or sample ids differ from the manifest's; "
                                f"remove the shard (`embedcache rm`) and extract again")
            digests.append(got.chunk)
            feature_digests.append(got.features)
            row_digests.append(got.rows)
        _drop_consolidated(store)
        shard.attrs.update({"chunk_sha256": digests, "rows_sha256": row_digests,
                            **({"features_sha256": feature_digests} if spec.views > 1 else {})})
        shard.attrs["complete"] = True


def write_shard(store: str | Path, spec: ShardSpec, features: np.ndarray, views: np.ndarray | None = None,
                mask: np.ndarray | None = None, *, names_checked: bool = False) -> None:
    """Write a whole shard from in-memory arrays (used by `import`), chunk by chunk."""
    if prepare_shard(store, spec, names_checked=names_checked):
        return  # the same features are already there, complete
    shard = open_shard(store, spec.backbone, spec.client, spec.split)
    for chunk in range(spec.n_chunks):
        a, b = spec.rows(chunk)
        write_chunk(shard, chunk, features[a:b], None if views is None else views[:, a:b],
                    None if mask is None else mask[a:b])
    finalize_shard(store, spec)

