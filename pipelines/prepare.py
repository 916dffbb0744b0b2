"""Partition and extraction for a sweep, done once on the driver before any cell runs.

Layout of the cache directory (docs/contracts.md, section 9):

    CACHE/manifests/<request key>.json      one manifest per (source, recipe, seed): `embedcache partition`
    CACHE/features/<source key>/<h>.zarr    feature pools: stores of "delta" manifests (one client per
    CACHE/features/<source key>/<h>.json    domain) holding images no earlier pool had, per backbone
    CACHE/stores/<manifest hash>.zarr       one ordinary feature store per manifest (contract 4)

An image's features are computed once per backbone, whatever the number of manifests that use it
(an alpha sweep re-partitions the same images five times): missing images go into a new pool
through `embedcache.extraction.extract` (fingerprinted, resumable, locked), then each manifest's
store is derived from the pools shard by shard with the store's own writer. A derived shard has
the cache key an extraction of that manifest would give it (backbone, weights, preprocessing,
sample list, dtype), so `fedheads train` / `finetune` read it like any other. Every write goes
through embedcache.store (per-client locks, atomic completion), so two sweeps sharing a cache
are safe.
"""

from __future__ import annotations

import hashlib
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from embedcache.errors import UserError
from embedcache.manifest import Client, Manifest, canonical_json, load_manifest, save_manifest

POOL_SCHEME = "pipelines-feature-pool"  # recipe scheme of a pool's manifest


@dataclass(frozen=True)
class DataRequest:
    """A partition to make: the resolved source and embedcache Recipe fields."""

    source: str
    recipe: tuple[tuple[str, Any], ...]  # embedcache.partitioning.Recipe fields (domains as a tuple)
    seed: int
    dataset: str  # pipelines.datasets key, to check the classes of a real copy
    original: bool  # the user's copy (--source) rather than the stand-in
    train_total: int | None = None  # label shift: resolved to train_fraction from the domains' sizes
    max_train_fraction: float = 0.5
    domain_map: tuple[tuple[str, str], ...] = ()  # paper domain -> source domain (not part of the key)

    def key(self) -> str:
        return hashlib.sha256(canonical_json({"source": self.source, "recipe": dict(self.recipe), "seed": self.seed,
                                              "train_total": self.train_total,
                                              "max_train_fraction": self.max_train_fraction}).encode()).hexdigest()[:20]


@dataclass
class Prepared:
    manifest_path: Path
    manifest_hash: str
    store: Path | None  # None: no features wanted (the cells encode live)
    features: dict[str, Any]  # fedheads.run.train.store_fingerprint: classes + per backbone dim/weights/preprocess
    clients: list[str]
    notes: list[str] = field(default_factory=list)


def _note(notes: list[str], msg: str) -> None:
    notes.append(msg)
    print(f"note: {msg}", file=sys.stderr, flush=True)


def manifest_for(req: DataRequest, cache: Path, notes: list[str]) -> Manifest:
    """The manifest of `req`, partitioned once and re-partitioned when its images changed."""
    from embedcache.partitioning import Recipe, partition
    from embedcache.sources import open_source
    from embedcache.sources.drift import check_unchanged
    from pipelines.datasets import check_classes

    path = cache / "manifests" / f"{req.key()}.json"
    source = open_source(req.source)
    if path.is_file():
        m = load_manifest(path)
        try:
            check_unchanged(m, source)
            return m
        except UserError as exc:  # images changed: record them as they are now (new cache keys)
            _note(notes, f"{path.name}: re-partitioned ({exc})")
    if req.original:
        check_classes(req.dataset, list(source.classes()), req.source)
    fields = dict(req.recipe)
    if req.train_total is not None:
        domains = set(fields.get("domains") or ())
        n = sum(1 for d, _, _ in source.index() if not domains or d in domains)
        fields["train_fraction"] = round(min(req.max_train_fraction, req.train_total / max(n, 1)), 4)
    m = partition(source, Recipe(**fields), req.seed)
    for w in m.report.get("warnings", []):
        _note(notes, f"{req.source}: {w}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_manifest(m, path)
    return m


def _complete(store: Path, manifest: Manifest, backbones: list[str]) -> bool:
    if not (store / "zarr.json").exists():
        return False
    from embedcache.store.reader import open_store

    info = open_store(store, quiet=True)
    if info.manifest_hash != manifest.content_hash:
        return False
    for b in backbones:
        for c in manifest.clients:
            for split in ("train", "test"):
                sh = info.shard(b, c.name, split)
                if sh is None or not sh.complete or not sh.current:
                    return False
    return True


def _pool_index(pool_dir: Path, backbone: str) -> dict[tuple[str, str], tuple[Path, str, int]]:
    """(sample id, fingerprint) -> (pool store, client, row) for every complete pool shard of `backbone`."""
    from embedcache.store.layout import open_group
    from embedcache.store.reader import open_store

    out: dict[tuple[str, str], tuple[Path, str, int]] = {}
    for js in sorted(pool_dir.glob("*.json")):
        store = js.with_suffix(".zarr")
        if not (store / "zarr.json").exists():
            continue
        fps = {s.id: s.fingerprint for c in load_manifest(js).clients for s in c.train}
        info = open_store(store, quiet=True)
        root = None
        for sh in info.shards:
            if sh.backbone != backbone or sh.split != "train" or not sh.complete or not sh.current:
                continue
            root = root or open_group(info.path, info.consolidated)
            ids = root[sh.path]["sample_ids"][:]
            for row, sid in enumerate(ids.tolist()):
                out.setdefault((sid, fps.get(sid, "")), (store, sh.client, row))
    return out


def _pool_manifest(manifest: Manifest, samples: list[tuple[str, Any]]) -> Manifest:
    """A manifest holding `samples` ((domain, Sample) pairs) as training rows, one client per domain."""
    from embedcache.partitioning import client_name

    by_dom: dict[str, list] = defaultdict(list)
    for dom, s in samples:
        by_dom[dom].append(s)
    clients = tuple(Client(client_name(i, d), d, tuple(sorted(by_dom[d], key=lambda s: s.id)), ())
                    for i, d in enumerate(sorted(by_dom)))
    recipe = {"scheme": POOL_SCHEME, "fingerprint": manifest.fingerprint_kind}
    return Manifest(source=manifest.source, classes=manifest.classes, clients=clients, recipe=recipe,
                    seed=0, report={}).validate()


def ensure_features(manifest: Manifest, backbones: list[str], store: Path, cache: Path, *,
                    weights_dir: str | None = None, scheduler: str | None = None, progress: bool = True,
                    notes: list[str] | None = None) -> None:
    """Make `store` hold every shard of `manifest` for `backbones` (see the module docstring)."""
    from embedcache.extraction import ExtractConfig, extract

    notes = notes if notes is not None else []
    if _complete(store, manifest, backbones):
        return
    pool_dir = cache / "features" / hashlib.sha256(manifest.source.encode()).hexdigest()[:16]
    pool_dir.mkdir(parents=True, exist_ok=True)
    needed = {(s.id, s.fingerprint): (c.domain, s) for c in manifest.clients
              for split in (c.train, c.test) for s in split}
    groups: dict[tuple, list[str]] = defaultdict(list)  # missing samples -> backbones lacking them
    for b in backbones:
        have = _pool_index(pool_dir, b)
        groups[tuple(sorted(k for k in needed if k not in have))].append(b)
    for missing, bbs in groups.items():
        if not missing:
            continue
        pool = _pool_manifest(manifest, [needed[k] for k in missing])
        path = pool_dir / f"{pool.content_hash[:16]}.zarr"
        save_manifest(pool, path.with_suffix(".json"))
        _note(notes, f"extracting {len(missing)} images with {', '.join(bbs)} into the feature pool {path.name}")
        extract(pool, ExtractConfig(backbones=tuple(bbs), store=str(path), weights_dir=weights_dir,
                                    scheduler=scheduler, progress=progress))
    _derive(manifest, backbones, store, pool_dir)


def _derive(manifest: Manifest, backbones: list[str], store: Path, pool_dir: Path) -> None:
    """Write the manifest's shards from the pools, with the store's writer (cache keys as extract)."""
    from embedcache.extraction import ExtractConfig, build_specs
    from embedcache.store import writer as st
    from embedcache.store.reader import load_split, open_store, shard_attributes

    st.init_store(store, manifest.classes, manifest.content_hash, [c.name for c in manifest.clients],
                  source=manifest.source)
    fps = {(c.name, split): [s.fingerprint for s in getattr(c, split)] for c in manifest.clients
           for split in ("train", "test")}
    for b in backbones:
        index = _pool_index(pool_dir, b)
        first = next(iter(index.values()), None)
        if first is None:
            raise UserError(f"{b}: no features in the pool {pool_dir} (extraction failed?)")
        info = open_store(first[0], quiet=True)
        attrs = shard_attributes(info, next(s for s in info.shards if s.backbone == b))
        stub = SimpleNamespace(name=b, weights_sha256=attrs["weights_sha256"], preprocess=attrs["preprocess"],
                               feature_dim=int(attrs["dim"]))
        cache: dict[tuple[Path, str], np.ndarray] = {}
        for spec, _ in build_specs(manifest, stub, ExtractConfig(backbones=(b,), store=str(store))):
            rows = []
            for sid, fp in zip(spec.sample_ids, fps[(spec.client, spec.split)]):
                pstore, pclient, row = index[(sid, fp)]
                if (pstore, pclient) not in cache:  # whole pool shard, digests checked by the reader
                    cache[(pstore, pclient)] = load_split(pstore, [b], "train", clients=[pclient])[pclient].features
                rows.append(cache[(pstore, pclient)][row])
            feats = np.stack(rows) if rows else np.zeros((0, stub.feature_dim), np.float32)
            st.write_shard(store, spec, feats.astype(np.float32, copy=False))
    st.consolidate(store)


def prepare(req: DataRequest, backbones: list[str], cache: Path, *, weights_dir: str | None = None,
            scheduler: str | None = None, progress: bool = True) -> Prepared:
    """Partition (cached) and features (cached) for one data request and backbone list."""
    from embedcache.store.reader import open_store
    from fedheads.run.train import store_fingerprint

    notes: list[str] = []
    m = manifest_for(req, cache, notes)
    store = cache / "stores" / f"{m.content_hash[:20]}.zarr"
    if not backbones:  # the cell encodes its images itself (FedDRA without a token store)
        return Prepared(manifest_path=cache / "manifests" / f"{req.key()}.json", manifest_hash=m.content_hash,
                        store=None, features={"classes": list(m.classes), "backbones": {}},
                        clients=[c.name for c in m.clients], notes=notes)
    ensure_features(m, backbones, store, cache, weights_dir=weights_dir, scheduler=scheduler,
                    progress=progress, notes=notes)
    return Prepared(manifest_path=cache / "manifests" / f"{req.key()}.json", manifest_hash=m.content_hash,
                    store=store, features=store_fingerprint(open_store(store, quiet=True), backbones),
                    clients=[c.name for c in m.clients], notes=notes)
