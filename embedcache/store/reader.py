"""Read API of the feature store (docs/contracts.md, section 4). Imports numpy and zarr only
(never torch, timm or dask), so `fedheads` can read features without the extraction stack.

`load_split` concatenates the features of the requested backbones column-wise, in the order
asked: FedPCL's r(x; Phi*) = concat(r_1(x; phi_1*), ..., r_K(x; phi_K*))
(Tan et al., NeurIPS 2022, Eq. 1-2).

Nothing is handed out that was not written and checked (`embedcache.store.checked_reads`): zarr reads
a deleted chunk file as fill values, so without the check a lost file would train on zeros.
Consolidated metadata is used only when it matches the shard groups on disk; otherwise each
shard's own metadata is read and a `StoreWarning` says so, once. Metadata is read as JSON
(`layout.StoreNodes`) and chunks of the writer's layout from their files
(`embedcache.store.chunk_files`), not through zarr objects: per shard, those cost more than the
bytes of a small shard.

Token states (FedDRA's stage 1): a text token shard holds rows T-major plus a `mask` [N, T]; an
image cut map holds rows C-major ([C, H, W] flattened: H*W tokens of C channels).
`ClientSplit.tokens()` gives both as [N, T, D]; `ClientSplit.mask` is the text mask.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from embedcache.errors import UserError
from embedcache.store.checked_reads import Rows, RowStream, ShardReader
from embedcache.store.layout import (
    OLDER,
    SPLITS,
    STORE_FORMAT,
    ShardInfo,
    StoreNodes,
    consolidated_entries,
    consolidated_problem,
    disk_shard_paths,
    note,
    root_metadata,
    stale_reason,
)


@dataclass(frozen=True)
class StoreInfo:
    """What a store holds: its classes and shards."""

    path: str  # store directory
    classes: tuple[str, ...]  # class names; labels index them
    manifest_hash: str  # manifest of the latest extraction into this store
    backbones: tuple[str, ...]  # backbone names present
    clients: tuple[str, ...]  # the store's clients: its latest manifest's (see init_store), else all with shards
    shards: tuple[ShardInfo, ...]  # every shard, current or stale, sorted by (backbone, client, split)
    consolidated: bool = False  # the consolidated metadata was used (it matched the files)
    source: str = ""  # the latest extraction's manifest source (contract 4), "" in older stores

    def shard(self, backbone: str, client: str, split: str) -> ShardInfo | None:
        index = self.__dict__.get("_index")
        if index is None:  # built once: callers ask per client and split (O(1) each at 1,000s of shards)
            index = {}
            for s in self.shards:
                index.setdefault((s.backbone, s.client, s.split), s)
            object.__setattr__(self, "_index", index)
        return index.get((backbone, client, split))

    def nodes(self) -> StoreNodes:
        """The metadata of the store's nodes, as open_store read it (one snapshot with `shards`);
        read again after `release_root` or unpickling."""
        nodes = self.__dict__.get("_nodes")
        if nodes is None:
            entries = consolidated_entries(root_metadata(self.path)) if self.consolidated else None
            nodes = StoreNodes(self.path, entries if isinstance(entries, dict) else None)
            object.__setattr__(self, "_nodes", nodes)
        return nodes

    def root(self) -> zarr.Group:
        """The store's root group (zarr), opened once per StoreInfo, for what the direct reads of
        `nodes()` do not cover; it opens the hierarchy, not the consolidated metadata, whose parse
        into zarr objects grows with the number of shards."""
        return self.nodes().root()

    def release_root(self) -> None:
        """Let go of the parsed metadata (tens of MB at 1,000s of shards) and the root group, e.g.
        once a run has read its features: nodes() and root() would read them again."""
        self.__dict__.pop("_nodes", None)

    def __getstate__(self) -> dict:  # the caches are rebuilt where the StoreInfo is unpickled (dask workers)
        return {k: v for k, v in self.__dict__.items() if k not in ("_index", "_nodes")}


@dataclass(frozen=True)
class ClientSplit:
    """One client's split with the requested backbones' features concatenated."""

    client: str  # client name
    domain: str  # client's domain
    features: np.ndarray  # [N, sum D_k] float32, backbones in the order asked (FedPCL Eq. 1-2)
    labels: np.ndarray  # [N] int64
    sample_ids: np.ndarray  # [N] str
    views: np.ndarray | None = None  # [V, N, sum D_k] float32 augmented views, when asked for
    mask: np.ndarray | None = None  # [N, T] bool, True = a real token (text token shards only)
    token_shape: tuple[int, int] | None = None  # (T, D) when the features are ONE backbone's token states
    channels_first: bool = False  # rows are C-major [D, T] (image cut maps), else T-major [T, D]

    def tokens(self) -> np.ndarray:
        """The features as [N, T, D] token states (a view for text, a copy for image maps)."""
        if self.token_shape is None:
            raise UserError(f"{self.client}: these features are not the token states of one backbone "
                            "(load one B@CUT backbone alone)")
        t, d = self.token_shape
        n = self.features.shape[0]
        if self.channels_first:
            return np.ascontiguousarray(self.features.reshape(n, d, t).transpose(0, 2, 1))
        return self.features.reshape(n, t, d)


def _shard_info(path: str, a: dict[str, Any], root_attrs: dict[str, Any]) -> ShardInfo:
    bkey, client, split = path.split("/")
    mh = str(a.get("manifest_hash", ""))
    tshape, mshape = a.get("token_shape"), (a.get("preprocess") or {}).get("map_shape")
    return ShardInfo(
        backbone=str(a["backbone"]), key=bkey, client=client, split=split,
        domain=str(a.get("domain", "")), n=int(a["n"]), dim=int(a["dim"]), dtype=str(a["dtype"]),
        views=int(a.get("views", 1)), complete=bool(a.get("complete", False)),
        cache_key=str(a["cache_key"]), path=path, manifest_hash=mh,
        stale=stale_reason(root_attrs, client, mh), modality=str(a.get("modality", "image")),
        token_shape=None if tshape is None else (int(tshape[0]), int(tshape[1])),
        map_shape=None if mshape is None else tuple(int(v) for v in mshape),
        weights_sha256=str(a.get("weights_sha256", "")),
        preprocess=json.dumps(a.get("preprocess"), sort_keys=True, separators=(",", ":")))


def _walk(nodes: StoreNodes, paths: Iterable[str], root_attrs: dict[str, Any]) -> list[ShardInfo]:
    """Every shard among the `<backbone>/<client>/<split>` groups `paths`, sorted by
    (backbone key, client, split); a group without a cache key is a shard being created."""
    shards = []
    if isinstance(root_attrs.get("clients"), list):  # stale_reason asks it per shard: a set, not a list scan
        root_attrs = {**root_attrs, "clients": frozenset(root_attrs["clients"])}
    for path in sorted(paths, key=lambda p: p.split("/")):
        a = nodes.attributes(path)
        if a is not None and path.rsplit("/", 1)[1] in SPLITS and "cache_key" in a:
            shards.append(_shard_info(path, a, root_attrs))
    return shards


def open_store(path: str | Path, *, quiet: bool = False) -> StoreInfo:
    """Describe a store from its metadata alone (no feature is read). Uses the consolidated
    metadata only when it matches the shard groups on disk; otherwise reads each shard's own
    metadata and warns once (`quiet=True`: no warning, for `verify`, which reports it as a problem)."""
    meta = root_metadata(path)
    attrs = meta["attributes"]
    if attrs.get("format") != STORE_FORMAT:
        raise UserError(f"{path}: not an embedcache store (format={attrs.get('format')!r})")
    problem = consolidated_problem(path, meta)
    entries = consolidated_entries(meta)
    use = isinstance(entries, dict) and problem is None
    shards, nodes = None, None
    if isinstance(entries, dict) and use:
        try:
            nodes = StoreNodes(path, entries)
            shards = _walk(nodes, (k for k in entries if k.count("/") == 2), attrs)
        except Exception as exc:  # e.g. malformed attributes: the files may hold better ones
            problem, use = f"is unreadable ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})", False
    if shards is None:
        if problem and not quiet:
            note(f"{path}: consolidated metadata {problem}; reading the hierarchy instead "
                 "(the next write, or `embedcache verify --repair`, rewrites it)")
        try:
            nodes = StoreNodes(path)
            shards = _walk(nodes, disk_shard_paths(path), attrs)
        except Exception as exc:
            raise UserError(f"{path}: cannot read the store's metadata ({type(exc).__name__}: {exc})") from None
    info = StoreInfo(
        path=str(path), classes=tuple(attrs.get("classes", ())), manifest_hash=str(attrs.get("manifest_hash", "")),
        backbones=tuple(sorted({s.backbone for s in shards})),
        clients=tuple(sorted(attrs["clients"] if attrs.get("clients") is not None else {s.client for s in shards})),
        shards=tuple(shards), consolidated=use, source=str(attrs.get("source", "")))
    object.__setattr__(info, "_nodes", nodes)  # StoreInfo.nodes(): the metadata just walked, not read again
    return info


def is_imported(preprocess: Any) -> bool:
    """A shard's `preprocess` (a dict, or ShardInfo.preprocess's JSON) says `embedcache import` wrote it."""
    p = json.loads(preprocess) if isinstance(preprocess, str) else preprocess
    return isinstance(p, dict) and "imported_from" in p


def identity_conflict(held: Sequence[tuple[str, str, Any]]) -> tuple[str, str] | None:
    """Two holders (shards, or Flower nodes) whose features of one backbone name cannot come from
    the same model, from their (who, weights_sha256, preprocess) - None when none can be told
    apart. Extracted features must agree on weights and preprocessing; imported ones carry the
    identity of their file, not of a model, so several imports may share a name (only their
    dimension can be checked) but an import beside extracted features cannot be shown to match
    them. Used by training (`check_backbone_identity`) and the Flower server alike."""
    extracted: dict[tuple[str, str], str] = {}
    imported: list[str] = []
    for who, weights, preprocess in held:
        if is_imported(preprocess):
            imported.append(who)
        else:
            pkey = json.dumps(json.loads(preprocess) if isinstance(preprocess, str) else preprocess, sort_keys=True)
            extracted.setdefault((str(weights), pkey), who)
    if len(extracted) > 1:
        a, b = list(extracted.values())[:2]
        return a, b
    if extracted and imported:
        return next(iter(extracted.values())), imported[0]
    return None


def check_backbone_identity(info: StoreInfo, backbones: Sequence[str], clients: Sequence[str],
                            splits: Sequence[str] = SPLITS) -> None:
    """UserError when the shards of one backbone name that a run would use hold features of
    different models (see identity_conflict): they would be trained together as one feature space."""
    wanted = set(clients)
    for b in backbones:
        shards = {s.path: s for s in info.shards if s.backbone == b and s.client in wanted and s.split in splits}
        pair = identity_conflict([(s.path, s.weights_sha256, s.preprocess) for s in shards.values()])
        if pair is not None:
            x, y = shards[pair[0]], shards[pair[1]]
            how = "one extracted, one imported" if is_imported(y.preprocess) else "extracted differently"
            raise UserError(f"backbone {b}: shards {x.path} (weights {x.weights_sha256[:12]}) and {y.path} (weights "
                            f"{y.weights_sha256[:12]}) hold features of different models or preprocessing ({how}); "
                            f"`embedcache rm` one of them, or import under another backbone name")


def _names(info: StoreInfo, backbones: Sequence[str] | str, split: str) -> list[str]:
    """The backbone list, each checked to be in the store."""
    names = [backbones] if isinstance(backbones, str) else list(backbones)
    if split not in SPLITS:
        raise UserError(f"split {split}: must be train or test")
    if not names:
        raise UserError("backbones: at least one is needed")
    for name in names:
        if name not in info.backbones:
            raise UserError(f"backbone {name}: not in store {info.path} (has: {', '.join(info.backbones) or 'none'})")
    return names


def _servable_shard(info: StoreInfo, name: str, client: str, split: str) -> ShardInfo:
    """The complete shard, refused when stale: a listed client's shard from an older manifest
    would silently mix two manifests' samples. A client the latest manifest dropped is served
    only because it was asked for by name, and with a note."""
    sh = info.shard(name, client, split)
    if sh is None:
        raise UserError(f"{name}/{client}/{split}: shard missing from {info.path}")
    if not sh.complete:
        raise UserError(f"{sh.path}: shard incomplete (extraction interrupted?); run extract again")
    if sh.stale == OLDER:
        raise UserError(f"{sh.path}: stale, {OLDER} (the store's latest is {info.manifest_hash[:12]}); extract "
                        f"(or import) it again under the current manifest - a cache hit when its samples did not "
                        f"change - or remove it with `embedcache gc {info.path}`")
    if sh.stale:
        note(f"{sh.path}: serving a stale shard ({sh.stale}) because client {client} was asked for by name")
    return sh


def check_servable(info: StoreInfo, backbones: Sequence[str], clients: Sequence[str]) -> None:
    """The refusals a read of these clients' train and test splits would make (unknown backbone,
    missing, incomplete or stale shard), made now, without reading: a run that reads as it goes
    (fedheads' streamed layout) fails before its first round, not in it."""
    for split in SPLITS:
        names = _names(info, backbones, split)
        for c in clients:
            for name in names:
                sh = info.shard(name, c, split)
                if sh is None or not sh.complete or sh.stale == OLDER:
                    _servable_shard(info, name, c, split)  # its one line


def changed_since_open(info: StoreInfo, backbones: Sequence[str], client: str, split: str) -> str | None:
    """The path of a shard of `client`'s `split` whose metadata on disk is no longer what `info`
    read when the store was opened (extracted or imported again since: another cache key or other
    digests), else None. A reader that holds a store open tells that apart from damage with it."""
    for name in _names(info, backbones, split):
        sh = info.shard(name, client, split)
        if sh is None:
            continue
        then = info.nodes().attributes(sh.path) or {}
        try:
            now = json.loads((Path(info.path) / sh.path / "zarr.json").read_text()).get("attributes", {})
        except (OSError, ValueError, AttributeError):
            return sh.path  # gone or rewritten past reading
        if any(now.get(k) != then.get(k) for k in ("cache_key", "chunk_sha256", "rows_sha256")):
            return sh.path
    return None


def _token_layout(shards: Sequence[ShardInfo]) -> tuple[tuple[int, int] | None, bool]:
    """(token_shape, channels_first) of one backbone's features; (None, False) otherwise."""
    if len(shards) != 1:
        return None, False
    sh = shards[0]
    if sh.token_shape is not None:
        return sh.token_shape, False
    if sh.map_shape is not None and len(sh.map_shape) == 3:
        c, h, w = sh.map_shape
        return (h * w, c), True
    return None, False


def _same_rows(client: str, split: str, first: str, other: str, ids: tuple, labels: tuple) -> None:
    if not (np.array_equal(ids[0], ids[1]) and np.array_equal(labels[0], labels[1])):
        raise UserError(f"{client}/{split}: sample ids or labels differ between backbones "
                        f"{first} and {other}; re-extract with one manifest")


def load_split(
    store: str | Path | StoreInfo,
    backbones: Sequence[str] | str,
    split: str,
    clients: Sequence[str] | None = None,
    views: bool = False,
) -> dict[str, ClientSplit]:
    """Features of `split` for each client, the given backbones concatenated in order.

    Raises UserError when a backbone or shard is missing, a shard is incomplete or stale, two
    backbones disagree on the sample ids/labels of a client, a feature is NaN/inf, or a chunk
    does not match its recorded digests (missing or changed since it was written).

    A text token shard comes with its `mask` (checked with the features) and is loaded alone: a
    mask cannot follow concatenated columns. `ClientSplit.tokens()` gives [N, T, D].
    """
    info = store if isinstance(store, StoreInfo) else open_store(store)
    names = _names(info, backbones, split)
    # default: the store's clients (its latest manifest's), never shards a later manifest dropped
    wanted = list(clients) if clients is not None else list(info.clients)
    check_backbone_identity(info, names, wanted, (split,))
    nodes = info.nodes()
    out: dict[str, ClientSplit] = {}
    for client in wanted:
        shards = [_servable_shard(info, n, client, split) for n in names]
        if len(shards) > 1 and any(sh.token_shape is not None for sh in shards):
            masked = next(sh for sh in shards if sh.token_shape is not None)
            raise UserError(f"{masked.backbone}: token states with a mask are loaded alone, not concatenated "
                            f"with {', '.join(n for n in names if n != masked.backbone)}")
        parts: list[tuple[ShardInfo, Rows]] = []
        for sh in shards:
            reader = ShardReader(nodes, sh, views)
            parts.append((sh, reader.read(0, reader.n_chunks)))
        first_sh, first = parts[0]
        for sh, rows in parts[1:]:
            _same_rows(client, split, first_sh.backbone, sh.backbone, (first.ids, rows.ids),
                       (first.labels, rows.labels))
        feats = np.concatenate([rows.features for _, rows in parts], axis=1)
        vws = None
        if views:
            held = [(sh.backbone, rows.views) for sh, rows in parts if rows.views is not None]
            if len(held) != len(parts) or len({v.shape[0] for _, v in held}) > 1:
                raise UserError(f"{client}/{split}: backbones hold different numbers of views "
                                f"({', '.join(f'{b}={v.shape[0]}' for b, v in held)})")
            vws = np.concatenate([v for _, v in held], axis=2)
        token_shape, channels_first = _token_layout(shards)
        out[client] = ClientSplit(client=client, domain=first_sh.domain, features=feats,
                                  labels=first.labels, sample_ids=first.ids, views=vws, mask=first.mask,
                                  token_shape=token_shape, channels_first=channels_first)
    return out


def iter_split_chunks(
    store: str | Path | StoreInfo,
    backbones: Sequence[str] | str,
    split: str,
    client: str,
    chunk_rows: int = 65_536,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Stream one client's split in row chunks: (features [n, sum D_k] float32, labels [n],
    sample_ids [n]) per chunk, backbones concatenated in order. Memory is about one chunk
    (plus one stored chunk per backbone), whatever the shard size (batch prediction). Same
    checks as `load_split`, each stored chunk checked before its rows are yielded."""
    if chunk_rows < 1:
        raise UserError(f"chunk_rows {chunk_rows}: must be >= 1")
    info = store if isinstance(store, StoreInfo) else open_store(store)
    shards = [_servable_shard(info, name, client, split) for name in _names(info, backbones, split)]
    masked = [sh.backbone for sh in shards if sh.token_shape is not None]
    if masked:
        raise UserError(f"{masked[0]}: a token shard with a mask is not streamed; use load_split, which "
                        "returns the mask")
    if len({sh.n for sh in shards}) > 1:
        raise UserError(f"{client}/{split}: backbones hold different numbers of samples")
    nodes = info.nodes()
    streams = [RowStream(ShardReader(nodes, sh, False)) for sh in shards]
    n = shards[0].n
    for a in range(0, n, chunk_rows):
        b = min(a + chunk_rows, n)
        feats, labels, ids = [], np.empty(0, np.int64), np.empty(0, str)
        for k, (sh, stream) in enumerate(zip(shards, streams)):
            f, y, s = stream.take(a, b)
            if k == 0:
                labels, ids = y, s
            else:
                _same_rows(client, split, shards[0].backbone, sh.backbone, (ids, s), (labels, y))
            feats.append(f)
        yield (feats[0] if len(feats) == 1 else np.concatenate(feats, axis=1)), labels, ids  # one backbone: no copy


def features_identity(info: StoreInfo, backbones: Sequence[str], clients: Sequence[str]) -> str:
    """sha256 naming the features `iter_split_chunks` serves for these clients' train and test
    splits, without reading them: each shard's cache key and the digests of its chunks and rows
    recorded when it was finalised (every checked read compares the bytes with those digests)."""
    h = hashlib.sha256()
    nodes = info.nodes()
    for client in clients:
        for split in SPLITS:
            for name in _names(info, backbones, split):
                sh = info.shard(name, client, split)
                if sh is None:
                    continue
                a = nodes.attributes(sh.path) or {}
                h.update(json.dumps([sh.path, sh.cache_key, sh.n, a.get("chunk_sha256"), a.get("rows_sha256")],
                                    separators=(",", ":")).encode())
    return h.hexdigest()


def shard_attributes(store: str | Path | StoreInfo, shard: ShardInfo) -> dict:
    """All attributes of one shard (backbone, weights_sha256, preprocess, cache_key, ...)."""
    info = store if isinstance(store, StoreInfo) else open_store(store)
    attrs = info.nodes().attributes(shard.path)
    if attrs is None:
        raise UserError(f"{shard.path}: cannot read its attributes (its zarr.json is missing or unreadable)")
    return dict(attrs)


def shard_chunk_rows(store: str | Path | StoreInfo, shard: ShardInfo) -> int:
    """Rows per stored chunk of a shard (how it was written), from its metadata."""
    info = store if isinstance(store, StoreInfo) else open_store(store)
    meta = info.nodes().get(f"{shard.path}/features") or {}
    try:
        return int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    except (KeyError, TypeError, ValueError, IndexError):
        raise UserError(f"{shard.path}/features: chunk shape unreadable; run `embedcache verify {info.path}`") from None
