"""Read API of the feature store (docs/contracts.md, section 4). Imports numpy and zarr only
(never torch, timm or dask), so `fedheads` can read features without the extraction stack.

`load_split` concatenates the features of the requested backbones column-wise, in the order
asked: FedPCL's r(x; Phi*) = concat(r_1(x; phi_1*), ..., r_K(x; phi_K*))
(Tan et al., NeurIPS 2022, Eq. 1-2).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr

from embedcache.errors import UserError

_SPLITS = ("train", "test")


@dataclass(frozen=True)
class ShardInfo:
    """One (backbone, client, split) shard as described by its attributes."""

    backbone: str  # backbone name (attr `backbone`)
    key: str  # group name of the backbone in the store
    client: str  # client name
    split: str  # "train" or "test"
    domain: str  # client's domain
    n: int  # rows
    dim: int  # feature dimension D
    dtype: str  # storage dtype
    views: int  # V (a `views` array exists when V > 1)
    complete: bool  # True only once every chunk was written and checked
    cache_key: str  # sha256 of the settings that produced the shard
    path: str  # group path inside the store


@dataclass(frozen=True)
class StoreInfo:
    """What a store holds: its classes and shards."""

    path: str  # store directory
    classes: tuple[str, ...]  # class names; labels index them
    manifest_hash: str  # manifest of the latest extraction into this store
    backbones: tuple[str, ...]  # backbone names present
    clients: tuple[str, ...]  # the store's clients: its latest manifest's (see init_store), else all with shards
    shards: tuple[ShardInfo, ...]  # every shard, sorted by (backbone, client, split)

    def shard(self, backbone: str, client: str, split: str) -> ShardInfo | None:
        for s in self.shards:
            if s.backbone == backbone and s.client == client and s.split == split:
                return s
        return None


@dataclass(frozen=True)
class ClientSplit:
    """One client's split with the requested backbones' features concatenated."""

    client: str  # client name
    domain: str  # client's domain
    features: np.ndarray  # [N, sum D_k] float32, backbones in the order asked (FedPCL Eq. 1-2)
    labels: np.ndarray  # [N] int64
    sample_ids: np.ndarray  # [N] str
    views: np.ndarray | None = None  # [V, N, sum D_k] float32 augmented views, when asked for


def _open(path: str | Path) -> zarr.Group:
    p = Path(path)
    if not (p / "zarr.json").is_file():
        raise UserError(f"{p}: no feature store here (zarr.json missing)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # consolidated metadata is not yet in the v3 spec
        return zarr.open_group(str(p), mode="r", zarr_format=3)


def open_store(path: str | Path) -> StoreInfo:
    """Describe a store from its metadata alone (no feature is read)."""
    root = _open(path)
    if root.attrs.get("format") != "embedcache/1":
        raise UserError(f"{path}: not an embedcache store (format={root.attrs.get('format')!r})")
    shards: list[ShardInfo] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for bkey, bgroup in sorted(root.groups()):
            for client, cgroup in sorted(bgroup.groups()):
                for split, shard in sorted(cgroup.groups()):
                    a = shard.attrs
                    if split not in _SPLITS or "cache_key" not in a:
                        continue  # a shard being created: not yet a shard
                    shards.append(ShardInfo(
                        backbone=a["backbone"], key=bkey, client=client, split=split,
                        domain=a.get("domain", ""), n=int(a["n"]), dim=int(a["dim"]), dtype=a["dtype"],
                        views=int(a.get("views", 1)), complete=bool(a.get("complete", False)),
                        cache_key=a["cache_key"], path=f"{bkey}/{client}/{split}"))
    return StoreInfo(
        path=str(path), classes=tuple(root.attrs.get("classes", ())),
        manifest_hash=str(root.attrs.get("manifest_hash", "")),
        backbones=tuple(sorted({s.backbone for s in shards})),
        clients=tuple(sorted(root.attrs.get("clients") or {s.client for s in shards})), shards=tuple(shards))


def _names(info: StoreInfo, backbones: Sequence[str] | str, split: str) -> list[str]:
    """The backbone list, each checked to be in the store."""
    names = [backbones] if isinstance(backbones, str) else list(backbones)
    if split not in _SPLITS:
        raise UserError(f"split {split}: must be train or test")
    if not names:
        raise UserError("backbones: at least one is needed")
    for name in names:
        if name not in info.backbones:
            raise UserError(f"backbone {name}: not in store {info.path} (has: {', '.join(info.backbones) or 'none'})")
    return names


def _complete_shard(info: StoreInfo, name: str, client: str, split: str) -> ShardInfo:
    sh = info.shard(name, client, split)
    if sh is None:
        raise UserError(f"{name}/{client}/{split}: shard missing from {info.path}")
    if not sh.complete:
        raise UserError(f"{sh.path}: shard incomplete (extraction interrupted?); run extract again")
    return sh


def _str_ids(arr: object) -> np.ndarray:
    """zarr's variable-length strings as a plain numpy str array."""
    return np.array(np.asarray(arr).tolist(), dtype=str).reshape(-1)


def _same_rows(client: str, split: str, first: str, other: str, ids: tuple, labels: tuple) -> None:
    if not (np.array_equal(ids[0], ids[1]) and np.array_equal(labels[0], labels[1])):
        raise UserError(f"{client}/{split}: sample ids or labels differ between backbones "
                        f"{first} and {other}; re-extract with one manifest")


def _read(root: zarr.Group, info: ShardInfo, views: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    g = root[info.path]
    feats = np.asarray(g["features"][...], dtype=np.float32)
    labels = np.asarray(g["labels"][...], dtype=np.int64)
    ids = _str_ids(g["sample_ids"][...])
    vws = None
    if views:
        if info.views <= 1:
            raise UserError(f"{info.path}: no augmented views stored (extract with --views V > 1)")
        vws = np.asarray(g["views"][...], dtype=np.float32)
    if feats.shape != (info.n, info.dim) or labels.shape != (info.n,) or ids.shape != (info.n,):
        raise UserError(f"{info.path}: arrays do not match n={info.n}, dim={info.dim}")
    if not np.isfinite(feats).all() or (vws is not None and not np.isfinite(vws).all()):
        raise UserError(f"{info.path}: features contain NaN/inf")
    return feats, labels, ids, vws


def load_split(
    store: str | Path | StoreInfo,
    backbones: Sequence[str] | str,
    split: str,
    clients: Sequence[str] | None = None,
    views: bool = False,
) -> dict[str, ClientSplit]:
    """Features of `split` for each client, the given backbones concatenated in order.

    Raises UserError when a backbone or shard is missing, a shard is incomplete, two
    backbones disagree on the sample ids/labels of a client, or a feature is NaN/inf.
    """
    info = store if isinstance(store, StoreInfo) else open_store(store)
    names = _names(info, backbones, split)
    # default: the store's clients (its latest manifest's), never shards a later manifest dropped
    wanted = list(clients) if clients is not None else list(info.clients)
    root = _open(info.path)
    out: dict[str, ClientSplit] = {}
    for client in wanted:
        parts = [(sh, *_read(root, sh, views)) for sh in (_complete_shard(info, n, client, split) for n in names)]
        first = parts[0]
        for sh, _, labels, ids, _ in parts[1:]:
            _same_rows(client, split, first[0].backbone, sh.backbone, (first[3], ids), (first[2], labels))
        if views and len({p[4].shape[0] for p in parts}) > 1:
            raise UserError(f"{client}/{split}: backbones hold different numbers of views "
                            f"({', '.join(f'{p[0].backbone}={p[4].shape[0]}' for p in parts)})")
        feats = np.concatenate([p[1] for p in parts], axis=1)
        vws = np.concatenate([p[4] for p in parts], axis=2) if views else None
        out[client] = ClientSplit(client=client, domain=first[0].domain, features=feats,
                                  labels=first[2], sample_ids=first[3], views=vws)
    return out


def iter_split_chunks(
    store: str | Path | StoreInfo,
    backbones: Sequence[str] | str,
    split: str,
    client: str,
    chunk_rows: int = 65_536,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stream one client's split in row chunks: (features [n, sum D_k] float32, labels [n],
    sample_ids [n]) per chunk, backbones concatenated in order. Memory is one chunk, whatever
    the shard size (batch prediction). Same checks as `load_split`, done per chunk."""
    if chunk_rows < 1:
        raise UserError(f"chunk_rows {chunk_rows}: must be >= 1")
    info = store if isinstance(store, StoreInfo) else open_store(store)
    shards = [_complete_shard(info, name, client, split) for name in _names(info, backbones, split)]
    if len({sh.n for sh in shards}) > 1:
        raise UserError(f"{client}/{split}: backbones hold different numbers of samples")
    root = _open(info.path)
    groups = [root[sh.path] for sh in shards]
    n = shards[0].n
    for a in range(0, n, chunk_rows):
        b = min(a + chunk_rows, n)
        feats, labels, ids = [], None, None
        for sh, g in zip(shards, groups):
            f = np.asarray(g["features"][a:b], dtype=np.float32)
            y = np.asarray(g["labels"][a:b], dtype=np.int64)
            s = _str_ids(g["sample_ids"][a:b])
            if not np.isfinite(f).all():
                raise UserError(f"{sh.path}: features contain NaN/inf (rows {a}..{b - 1})")
            if labels is None:
                labels, ids = y, s
            else:
                _same_rows(client, split, shards[0].backbone, sh.backbone, (ids, s), (labels, y))
            feats.append(f)
        yield np.concatenate(feats, axis=1), labels, ids


def shard_attributes(store: str | Path | StoreInfo, shard: ShardInfo) -> dict:
    """All attributes of one shard (backbone, weights_sha256, preprocess, cache_key, ...)."""
    info = store if isinstance(store, StoreInfo) else open_store(store)
    return dict(_open(info.path)[shard.path].attrs)
