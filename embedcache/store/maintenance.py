"""Store maintenance behind `embedcache inspect | verify | gc | rm | export` (and `import`,
in `embedcache.store.importer`).

`verify` never trusts the consolidated metadata: it walks the hierarchy, re-reads every chunk
and checks it against the digests recorded at finalisation, and reports consolidated metadata
that no longer matches the files; `inspect` marks every shard current or stale (contract 4);
`gc` removes the stale ones and `rm` chosen ones (`export` lives in `embedcache.store.export`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zarr

from embedcache.errors import UserError
from embedcache.store import writer as st
from embedcache.store.layout import (
    BACKUP_PREFIX,
    STORE_FORMAT,
    ShardInfo,
    array,
    consolidate,
    consolidated_mismatch,
    dir_lock,
    disk_clients,
    disk_shard_paths,
    drop_consolidated,
    holds_shards,
    quiet_open,
    read,
    read_attrs,
    root_metadata,
    stale_reason,
    store_writes,
    subgroups,
    write_json_atomic,
)
from embedcache.store.reader import open_store

REQUIRED_ATTRS = ("cache_key", "backbone", "weights_sha256", "preprocess", "manifest_hash", "sample_list_hash",
                  "code_version", "dtype", "views", "n", "dim", "domain", "chunk_sha256", "complete")


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def inspect_store(path: str | Path) -> dict:
    """Shards with N, D, dtype, views, bytes on disk, completeness and current/stale."""
    info = open_store(path)
    shards = [{"shard": s.path, "backbone": s.backbone, "client": s.client, "split": s.split, "domain": s.domain,
               "n": s.n, "dim": s.dim, "dtype": s.dtype, "views": s.views, "complete": s.complete,
               "current": s.current, "stale": s.stale or None, "manifest_hash": s.manifest_hash,
               "bytes": _du(Path(path) / s.path)} for s in info.shards]
    return {"store": str(path), "classes": list(info.classes), "manifest_hash": info.manifest_hash,
            "backbones": list(info.backbones), "clients": list(info.clients), "shards": shards,
            "stale_shards": sum(not s["current"] for s in shards),
            "bytes": _du(Path(path)), "complete": all(s["complete"] for s in shards)}


def _shard_groups(path: Path) -> tuple[list[tuple[str, zarr.Group]], list[str]]:
    """Every shard group on disk, each opened on its own (a damaged one does not hide the
    others), and the problems of the groups that cannot be opened."""
    out, probs = [], []
    for parent in sorted({str(Path(s).parent) for s in disk_shard_paths(path)} | set(subgroups(path))):
        try:
            root_metadata(path / parent)
        except UserError as exc:
            probs.append(f"{parent}: group metadata unreadable ({exc})")
    for name in sorted(disk_shard_paths(path)):
        try:
            out.append((name, quiet_open(path / name, "r", use_consolidated=False)))
        except Exception as exc:
            probs.append(f"{name}: unreadable ({type(exc).__name__}: {' '.join(str(exc).split())})")
    return out, probs


def _chunk_problems(name: str, shard: zarr.Group, a: dict[str, Any]) -> list[str]:
    n_chunks = array(shard, "done").shape[0]
    lists = {k: a[k] for k in ("chunk_sha256", "rows_sha256", "features_sha256") if k in a}
    for k, v in lists.items():
        if not isinstance(v, list) or len(v) != n_chunks:
            return [f"{name}: {len(v) if isinstance(v, list) else 'no'} {k} digests for {n_chunks} chunks"]
    probs = []
    for chunk in range(n_chunks):
        got = st.stored_digests(shard, chunk)
        want_features = lists.get("features_sha256", [got.features] * n_chunks)[chunk]
        if got.chunk != lists["chunk_sha256"][chunk] or got.features != want_features:
            probs.append(f"{name}: chunk {chunk} sha256 mismatch")
        if "rows_sha256" in lists and got.rows != lists["rows_sha256"][chunk]:
            probs.append(f"{name}: chunk {chunk} labels or sample ids changed (rows sha256 mismatch)")
    return probs


def verify_shard(name: str, shard: zarr.Group, n_classes: int) -> list[str]:
    """Problems of one shard (empty list: complete and consistent)."""
    a: dict[str, Any] = dict(shard.attrs)
    missing = [k for k in REQUIRED_ATTRS if k not in a]
    if missing:
        return [f"{name}: attributes missing: {', '.join(missing)}"]
    if a["complete"] is not True:
        return [f"{name}: not complete"]
    n, d, v = int(a["n"]), int(a["dim"]), int(a["views"])
    probs = []
    token_shape = a.get("token_shape")
    for arr, shape in (("features", (n, d)), ("labels", (n,)), ("sample_ids", (n,)), ("done", None)) + (
            (("views", (v, n, d)),) if v > 1 else ()) + (
            (("mask", (n, int(token_shape[0]))),) if token_shape is not None else ()):
        found = shard.get(arr)
        if found is None:
            probs.append(f"{name}: array {arr} missing")
        elif not isinstance(found, zarr.Array):
            probs.append(f"{name}: {arr} is a group, not an array")
        elif shape is not None and found.shape != shape:
            probs.append(f"{name}: {arr} shape {found.shape} != {shape}")
    if probs:
        return probs
    labels = read(shard, "labels")
    if n and (labels.min() < 0 or labels.max() >= n_classes):
        probs.append(f"{name}: labels outside 0..{n_classes - 1}")
    if len(set(read(shard, "sample_ids").tolist())) != n:
        probs.append(f"{name}: sample ids not unique")
    return probs + _chunk_problems(name, shard, a)


def _name_problems(path: Path) -> list[str]:
    """Names that differ only in letter case (contract 4), left by older versions."""
    listed = root_metadata(path)["attributes"].get("clients") or []
    probs = []
    for kind, names in (("backbone groups", subgroups(path)), ("clients", sorted(disk_clients(path) | set(listed)))):
        seen: dict[str, str] = {}
        for name in names:
            first = seen.setdefault(name.casefold(), name)
            if first != name:
                probs.append(f"{path}: {kind} {first} and {name} differ only in letter case (one directory on a "
                             "case-insensitive file system); `embedcache rm` one of them")
    return probs


def verify_store(path: str | Path) -> list[str]:
    """Every problem found in the store; empty when every shard is complete and consistent and
    the consolidated metadata (if any) matches the files. Never trusts consolidated metadata."""
    path = Path(path)
    attrs = st.store_root(path)
    if attrs is None:
        raise UserError(f"{path}: no feature store here (zarr.json missing)")
    probs = []
    stale = consolidated_mismatch(path)
    if stale:
        probs.append(f"{path}: consolidated metadata {stale}; `embedcache verify --repair` rewrites it")
    probs += _name_problems(path)
    groups, unreadable = _shard_groups(path)
    probs += unreadable
    for name, shard in groups:
        try:
            probs += verify_shard(name, shard, len(attrs.get("classes", [])))
        except Exception as exc:  # a chunk file zarr cannot decode
            probs.append(f"{name}: unreadable ({type(exc).__name__}: {' '.join(str(exc).split())})")
    if not probs and not groups:
        probs.append(f"{path}: no shards")
    return probs


def verify_against_manifest(path: str | Path, manifest: object) -> list[str]:
    """Problems between the store and `manifest`: images changed since the manifest was written
    (their fingerprints, contract 2), and shards whose samples are not the manifest's (every
    backbone of the store, every client and split of the manifest)."""
    from embedcache.sources.drift import EXAMPLES, find_changes
    from embedcache.store.reader import shard_attributes

    info = open_store(path)
    probs = []
    changes = find_changes(manifest)  # type: ignore[arg-type]
    if changes:
        kind = manifest.fingerprint_kind  # type: ignore[attr-defined]
        shown = ", ".join(c.describe(kind) for c in changes[:EXAMPLES])
        probs.append(f"{len(changes)} image(s) changed since the manifest was written (e.g. {shown}); the "
                     "features of this store no longer describe them: re-run partition, then extract")
    for b in info.backbones:
        for c in manifest.clients:  # type: ignore[attr-defined]
            for split in st.SPLITS:
                sh = info.shard(b, c.name, split)
                if sh is None:
                    probs.append(f"{b}/{c.name}/{split}: no shard for this manifest's client")
                elif shard_attributes(info, sh).get("sample_list_hash") != manifest.sample_list_hash(c.name, split):  # type: ignore[attr-defined]
                    probs.append(f"{sh.path}: holds other samples than the manifest's {c.name}/{split}")
    return probs


def _salvaged_attrs(text: str) -> dict | None:
    """The root's attributes from what is left of a damaged zarr.json: they are written first
    (before the long consolidated metadata), so a truncated file usually still holds them."""
    at = text.find('"attributes"')
    start = text.find("{", at) if at >= 0 else -1
    if start < 0:
        return None
    try:
        attrs, _ = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    ok = isinstance(attrs, dict) and attrs.get("format") == STORE_FORMAT and isinstance(attrs.get("classes"), list)
    return attrs if ok else None


def _disk_shards(path: Path) -> list[tuple[str, dict]]:
    """(client, attributes) of every shard group on disk whose zarr.json is readable."""
    out = []
    for name in sorted(disk_shard_paths(path)):
        try:
            a = root_metadata(path / name)["attributes"]
        except UserError:
            continue  # `verify` reports it
        if "cache_key" in a:
            out.append((name.split("/")[1], a))
    return out


def repair_root(path: str | Path, manifest: Any = None) -> str | None:
    """Rebuild a store's root zarr.json when it is missing or unreadable but shards are on disk
    (data is never touched; the consolidated metadata is rewritten afterwards). The attributes
    come from `manifest` (the one last extracted into the store) when given, else from what is
    left of the damaged file. Returns what was done, None when the root was fine."""
    path = Path(path)
    p = path / "zarr.json"
    try:
        root_metadata(path)
        return None
    except UserError:
        if not holds_shards(path):
            raise
    shards = _disk_shards(path)
    old = _salvaged_attrs(p.read_text(errors="replace")) if p.is_file() else None
    if manifest is not None:
        mh = manifest.content_hash
        listed = [c.name for c in manifest.clients]
        attrs = {"format": STORE_FORMAT, "classes": list(manifest.classes), "manifest_hash": mh,
                 "clients": listed + sorted({c for c, a in shards if a.get("manifest_hash") == mh} - set(listed)),
                 "source": manifest.source}
        how = f"from {len(shards)} shard(s) and the manifest"
    elif old is not None:
        attrs = old
        how = f"from {len(shards)} shard(s) and the attributes left in the damaged file"
    else:
        raise UserError(f"{p}: the class names cannot be recovered from the shards; run `embedcache verify "
                        f"--repair {path} --manifest M` with the manifest last extracted into this store")
    with store_writes(path, "store"), dir_lock(path):
        write_json_atomic(p, {"attributes": attrs, "zarr_format": 3, "node_type": "group"})
    return f"root metadata {p} rebuilt {how}"


def repair_consolidated(path: str | Path) -> str | None:
    """Rewrite the consolidated metadata from the hierarchy when it is missing or does not
    match the files (data is never touched). Returns what was wrong, None when nothing was."""
    open_store(path, quiet=True)  # a store at all?
    meta = root_metadata(path)
    wrong = "is missing" if meta.get("consolidated_metadata") is None else consolidated_mismatch(path)
    if wrong:
        with store_writes(path, "store"):
            st.consolidate(path)
    return wrong


def gc_plan(path: str | Path) -> list[ShardInfo]:
    """The stale shards (contract 4) that `gc` removes."""
    return [s for s in open_store(path).shards if not s.current]


def rm_plan(path: str | Path, backbone: str, client: str | None = None, split: str | None = None) -> list[ShardInfo]:
    """The shards `rm` removes: those of `backbone` (its name or group key), narrowed by client and split."""
    info = open_store(path)
    keys = {s.key: s.backbone for s in info.shards}
    name = backbone if backbone in info.backbones else keys.get(backbone)
    if name is None:
        raise UserError(f"backbone {backbone}: not in store {path} (has: {', '.join(info.backbones) or 'none'})")
    if split is not None and split not in st.SPLITS:
        raise UserError(f"split {split}: must be train or test")
    shards = [s for s in info.shards if s.backbone == name]
    if client is not None and not any(s.client == client for s in shards):
        have = sorted({s.client for s in shards})
        raise UserError(f"client {client}: has no shard of backbone {name} in {path} (has: {', '.join(have)})")
    out = [s for s in shards if (client is None or s.client == client) and (split is None or s.split == split)]
    if not out:
        raise UserError(f"{name}/{client or '*'}/{split}: no such shard in {path}")
    return out


def remove(path: str | Path, shards: list[ShardInfo], *, only_stale: bool = False) -> list[str]:
    """Remove `shards` under the store's locks (see remove_shards); with
    `only_stale` (gc), also the shards set aside by killed imports."""
    with store_writes(path, "store"):
        done = remove_shards(path, [s.path for s in shards], only_stale=only_stale)
        return done + (sweep_import_leftovers(path) if only_stale else [])


def import_leftovers(path: str | Path) -> list[str]:
    """What `gc` would sweep besides stale shards (shards set aside by killed imports)."""
    return sweep_import_leftovers(path, dry_run=True)


def _dead_backups(cdir: Path) -> list[Path]:
    """Backups of imports whose process is gone (a killed import); a live one is left alone."""
    out = []
    for e in cdir.glob(f"{BACKUP_PREFIX}*"):
        try:
            os.kill(int(e.name[len(BACKUP_PREFIX):]), 0)
        except (ValueError, ProcessLookupError):
            out.append(e)
        except PermissionError:
            pass  # alive, someone else's
    return out


def remove_shards(store: str | Path, paths: Sequence[str], *, only_stale: bool = False) -> list[str]:
    """Remove shard groups `<backbone key>/<client>/<split>`, then client and backbone groups
    left without shards, and rewrite the consolidated metadata. With `only_stale`, each shard
    is re-checked under its client's lock and kept if a concurrent extract made it current.
    The root's client list never changes (a listed client without shards is reported by the
    reader as missing, never silently left out). Returns the paths removed."""
    store = Path(store)
    by_client: dict[tuple[str, str], list[str]] = {}
    for path in paths:
        bk, client, split = path.split("/")
        by_client.setdefault((bk, client), []).append(split)
    removed: list[str] = []
    for (bk, client), splits in sorted(by_client.items()):
        cdir = store / bk / client
        if not cdir.is_dir():
            continue
        with dir_lock(cdir):
            root_attrs = root_metadata(store)["attributes"]
            for split in splits:
                meta = cdir / split / "zarr.json"
                if not meta.is_file():
                    continue
                if only_stale and not stale_reason(root_attrs, client, str(read_attrs(meta).get("manifest_hash", ""))):
                    continue
                drop_consolidated(store)
                shutil.rmtree(cdir / split)
                removed.append(f"{bk}/{client}/{split}")
            if not subgroups(cdir):
                drop_consolidated(store)
                shutil.rmtree(cdir)
        with dir_lock(store):
            if (store / bk).is_dir() and not subgroups(store / bk):
                drop_consolidated(store, have_lock=True)
                shutil.rmtree(store / bk)
    consolidate(store)
    return removed


def sweep_import_leftovers(store: str | Path, *, dry_run: bool = False) -> list[str]:
    """Shards set aside by imports that were killed before they could restore or drop them
    (invisible to zarr, but disk space). Returns their paths relative to the store."""
    store = Path(store)
    found = []
    for bk in subgroups(store):
        for client in subgroups(store / bk):
            cdir = store / bk / client
            if not any(cdir.glob(f"{BACKUP_PREFIX}*")):
                continue
            with dir_lock(cdir):
                for backup in _dead_backups(cdir):
                    found.append(str(backup.relative_to(store)))
                    if not dry_run:
                        shutil.rmtree(backup, ignore_errors=True)
    return found
