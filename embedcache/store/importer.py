"""`embedcache import`: features computed elsewhere (.npz, .h5, .mat), an `embedcache export`, or
many clients at once (an HDF5 file with a group per client, a directory of per-client files)
become normal complete shards (docs/contracts.md, sections 4 and 4a; reading: `import_sources`).

A failed import leaves the store as it was, all or nothing for an import of many shards. Everything
that can be checked is checked before the store is touched (file, shapes, labels, dtype, classes,
names, feature dimension); if the write still fails (disk full, Ctrl-C), `_Undo` removes what the import created and restores
what it replaced, including the root's client list and consolidated metadata.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from embedcache.errors import UserError
from embedcache.manifest import canonical_json, check_client_name, check_domain
from embedcache.store import writer as st
from embedcache.store.import_sources import ImportItem, ImportSource, read_source
from embedcache.store.layout import BACKUP_PREFIX, collides, dir_lock, folded, other_shards, root_metadata, store_writes
from embedcache.store.reader import is_imported


def _checked(item: ImportItem, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features float32, labels int64, sample ids) of one item, or a UserError naming it."""
    feats, labels, ids, origin = item.features, item.labels, item.sample_ids, item.origin
    if feats.ndim != 2 or not np.issubdtype(feats.dtype, np.number):
        raise UserError(f"{origin}: features must be a numeric [N, D] array, got shape {feats.shape}")
    for what, arr in (("features", feats), ("labels", labels), ("views", item.views)):
        if arr is not None and np.iscomplexobj(arr):  # a cast to float would drop the imaginary part
            raise UserError(f"{origin}: {what} are complex ({arr.dtype}); import real values (e.g. their "
                            "magnitude or the real and imaginary parts as separate columns)")
    n = feats.shape[0]
    if labels.shape != (n,):
        raise UserError(f"{origin}: labels has {labels.size} entries for {n} feature rows (use --transpose for [D, N])")
    if not np.issubdtype(labels.dtype, np.number) or not np.all(labels == np.round(labels)):
        raise UserError(f"{origin}: labels must be integer class indices")
    if ids is None:
        ids = np.array([f"{item.client}/{item.split}/{i:06d}" for i in range(n)], dtype=str)
    if ids.shape != (n,) or len(set(ids.tolist())) != n:
        raise UserError(f"{origin}: sample_ids must be {n} unique strings")
    if item.views is not None and (item.views.ndim != 3 or item.views.shape[1:] != feats.shape):
        raise UserError(f"{origin}: views must be [V, {n}, {feats.shape[1]}], got {item.views.shape}")
    if item.mask is not None and (item.mask.ndim != 2 or item.mask.shape[0] != n or item.mask.dtype != bool):
        raise UserError(f"{origin}: mask must be a bool [{n}, T] array, got {item.mask.dtype} {item.mask.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        if not np.isfinite(feats).all() or not np.isfinite(feats.astype(dtype)).all():
            raise UserError(f"{origin}: features contain NaN/inf{' (as float16)' if dtype == 'float16' else ''}")
    return feats.astype(np.float32), labels.astype(np.int64), ids


class _Undo:
    """What an import is about to change, so that a failure can put it back: the metadata files
    on the shard's path (their bytes, or their absence) and the shard it replaces (moved into a
    directory zarr does not see, since it holds no zarr.json)."""

    def __init__(self, store: Path, bk: str, client: str, split: str, new_key: str, recorded: set[Path]) -> None:
        """`recorded`: the directories an earlier undo of the same import holds already (the store's
        root and backbone groups, whose metadata the first shard records; undone last, it wins)."""
        self.store, self.split = store, split
        self.store_existed = store.exists()
        self.dirs = [d for d in (store / bk / client / split, store / bk / client, store / bk, store) if d not in recorded]
        recorded.update(self.dirs)
        self.meta = {d: (d / "zarr.json").read_bytes() if (d / "zarr.json").is_file() else None for d in self.dirs}
        self.existed = {d: d.exists() for d in self.dirs}
        self.backup: Path | None = None
        shard = self.dirs[0]
        old = self.meta[shard]
        if old is not None and root_metadata(shard)["attributes"].get("cache_key") != new_key:
            self.backup = shard.parent / f"{BACKUP_PREFIX}{os.getpid()}"
            with dir_lock(shard.parent):
                self.backup.mkdir()
                os.rename(shard, self.backup / split)
            self.existed[shard] = False

    def commit(self) -> None:
        if self.backup is not None:
            shutil.rmtree(self.backup, ignore_errors=True)

    def undo(self) -> None:
        if self.store in self.meta and not self.store_existed:  # the import's first shard made the store
            shutil.rmtree(self.store, ignore_errors=True)
            return
        if self.store in self.meta and self.meta[self.store] is None:  # an empty directory made a store of
            for p in self.store.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            return
        for d in self.dirs:  # deepest first
            meta = self.meta[d]
            if not self.existed[d]:
                shutil.rmtree(d, ignore_errors=True)
            elif meta is not None and (not (d / "zarr.json").is_file() or (d / "zarr.json").read_bytes() != meta):
                tmp = d / f".zarr.json.{os.getpid()}.undo"
                tmp.write_bytes(meta)
                os.replace(tmp, d / "zarr.json")
        if self.backup is not None:
            os.rename(self.backup / self.split, self.dirs[0])
            shutil.rmtree(self.backup, ignore_errors=True)


def _precheck(store: Path, specs: list[st.ShardSpec], root: dict | None) -> None:
    """Everything the write would refuse, checked before the store is touched, for the whole
    import at once (names listed once, not once per shard)."""
    if root is None and store.exists() and (not store.is_dir() or any(p.name != "zarr.json" for p in store.iterdir())):
        raise UserError(f"{store}: directory is not empty and is not an embedcache store")
    listed = folded((root or {}).get("clients") or [])
    for spec in specs:
        other = next((o for o in listed.get(spec.client.casefold(), ()) if o != spec.client), None)
        if other is not None:
            raise collides("client", spec.client, other)
    st.check_client_names(store, list(dict.fromkeys(s.client for s in specs)))
    for backbone in dict.fromkeys(s.backbone for s in specs):
        st.check_backbone_name(store, backbone)
    for spec in specs:
        st.check_feature_dim(store, spec)


def _extracted_beside(store: Path, specs: list[st.ShardSpec]) -> None:
    """Refuse imported features under a backbone name whose shards in the store were extracted:
    an import carries its file's identity, not a model's, so it cannot be shown to come from the
    same weights, and training would use both as one feature space (reader.identity_conflict).
    The shards this import replaces do not count."""
    for bk in sorted({st.backbone_key(s.backbone) for s in specs}):
        mine = [s for s in specs if st.backbone_key(s.backbone) == bk]
        for path, a in other_shards(store, bk, [(s.client, s.split) for s in mine]):
            if not is_imported(a.get("preprocess")):
                raise UserError(f"--backbone {mine[0].backbone}: the store holds features extracted by that backbone "
                                f"(weights {str(a.get('weights_sha256'))[:12]}, e.g. {path}); these imported ones "
                                f"(file sha256 {mine[0].weights_sha256[:12]}) cannot be shown to come from the same "
                                "weights: import them under another backbone name")


def _file_sha(src: ImportSource) -> str:
    if len(src.files) == 1:
        return hashlib.sha256(src.files[0].read_bytes()).hexdigest()
    h = hashlib.sha256()
    for f in src.files:  # a directory: sha256 over its files' sha256s, in path order
        h.update(hashlib.sha256(f.read_bytes()).hexdigest().encode())
    return h.hexdigest()


def _classes(src: ImportSource, root: dict | None, classes: Sequence[str] | None, labels: list[np.ndarray]) -> list[str]:
    given = [("--classes", list(classes))] if classes else []
    given += [(f"{src.name} (exported classes)", list(src.classes))] if src.classes is not None else []
    if root is not None:
        cls = list(root.get("classes", []))
        for what, c in given:
            if c != cls:
                raise UserError(f"{what}: {c} differ from the store's classes {cls}")
    elif given:
        cls = given[0][1]
        for what, c in given[1:]:
            if c != cls:
                raise UserError(f"{what}: {c} differ from --classes {cls}")
    else:
        top = max((int(y.max()) for y in labels if y.size), default=-1)
        cls = [str(i) for i in range(top + 1)]
    for item_labels, origin in ((y, i.origin) for y, i in zip(labels, src.items)):
        if item_labels.size and (item_labels.min() < 0 or item_labels.max() >= len(cls)):
            raise UserError(f"{origin}: labels {item_labels.min()}..{item_labels.max()} outside the class list "
                            f"(0..{len(cls) - 1})")
    return cls


def _check_batch(specs: list[st.ShardSpec], origins: list[str]) -> None:
    """What two shards of one call could get wrong between them."""
    seen: dict[tuple[str, str, str], str] = {}
    dims: dict[str, tuple[int, str]] = {}
    clients: dict[str, str] = {}  # folded -> the first name
    for spec, origin in zip(specs, origins):
        key = (st.backbone_key(spec.backbone).casefold(), spec.client.casefold(), spec.split)
        if key in seen:
            raise UserError(f"{origin}: the same shard as {seen[key]} ({spec.backbone}/{spec.client}/{spec.split})")
        seen[key] = origin
        d, first = dims.setdefault(spec.backbone, (spec.feature_dim, origin))
        if d != spec.feature_dim:
            raise UserError(f"{origin}: feature dim {spec.feature_dim} differs from dim {d} of {first}")
        other = clients.setdefault(spec.client.casefold(), spec.client)
        if other != spec.client:
            raise collides("client", spec.client, other)


def import_many(store: str | Path, source: str | Path, *, backbone: str | None = None, client: str | None = None,
                split: str | None = None, domain: str | None = None, features_key: str = "features",
                labels_key: str = "labels", transpose: bool = False, classes: Sequence[str] | None = None,
                dtype: str | None = None, chunk_rows: int = st.DEFAULT_CHUNK_ROWS) -> list[st.ShardSpec]:
    """Import every shard `source` holds (docs/contracts.md, section 4a): one file of arrays, an
    `embedcache export` (.h5 or npz directory), an HDF5 file with a group per client, or a directory
    of per-client files. All or nothing: everything is read and checked before the store is
    touched, and a failure while writing undoes every shard written. Returns the written shards."""
    store = Path(store)
    if client is not None:
        check_client_name(client, "--client")
    if domain is not None:
        check_domain(domain, "--domain")
    if split is not None and split not in st.SPLITS:
        raise UserError(f"split {split}: must be train or test")
    if dtype is not None and dtype not in st.DTYPES:
        raise UserError(f"dtype {dtype}: must be one of {', '.join(st.DTYPES)}")
    if chunk_rows < 1:
        raise UserError(f"chunk_rows {chunk_rows}: must be >= 1")
    src = read_source(source, client=client, split=split, features_key=features_key, labels_key=labels_key,
                      transpose=transpose, backbone=backbone)
    if not src.exported and backbone is None:
        raise UserError(f"{source}: give --backbone (the name its shards are stored under)")
    if domain is not None and len({i.client for i in src.items}) > 1:
        raise UserError(f"--domain: only for one client ({source} holds several)")
    for item in src.items:
        check_client_name(item.client, item.origin)
        if item.domain is not None:
            check_domain(item.domain, item.origin)
    dtypes = [dtype or ("float16" if i.features.dtype == np.float16 else "float32") for i in src.items]
    arrays = [_checked(i, dt) for i, dt in zip(src.items, dtypes)]
    file_sha = _file_sha(src)
    root = st.store_root(store)
    cls = _classes(src, root, classes, [y for _, y, _ in arrays])
    manifest_hash = file_sha if root is None else str(root.get("manifest_hash", ""))
    specs = []
    for item, (feats, labels, ids), dt in zip(src.items, arrays, dtypes):
        # The manifest's formula (sha256 of [source, [[id, locator, label], ...]]), the file as source.
        sample_list_hash = hashlib.sha256(canonical_json(
            [f"import:{src.name}", [[i, i, int(y)] for i, y in zip(ids.tolist(), labels.tolist())]]).encode()).hexdigest()
        item_backbone = item.backbone if src.exported else backbone
        if item_backbone is None:  # checked above for a plain file; an export names each shard's
            raise UserError(f"{item.origin}: names no backbone; give --backbone")
        specs.append(st.ShardSpec(
            backbone=item_backbone,
            weights_sha256=file_sha, preprocess={"imported_from": src.name}, feature_dim=feats.shape[1],
            client=item.client, split=item.split, domain=domain or item.domain or item.client,
            manifest_hash=manifest_hash, sample_list_hash=sample_list_hash, sample_ids=tuple(ids.tolist()),
            labels=tuple(labels.tolist()), views=1 if item.views is None else item.views.shape[0], dtype=dt,
            chunk_rows=chunk_rows, modality=item.modality, token_shape=item.token_shape))
    _check_batch(specs, [i.origin for i in src.items])
    if root is not None:
        _extracted_beside(store, specs)
    _precheck(store, specs, root)
    new_clients = list(dict.fromkeys(s.client for s in specs))
    undos: list[_Undo] = []
    with store_writes(store):  # disk full, read-only: one line naming the path, after the undo
        _write_all(store, specs, src, arrays, cls, manifest_hash, root, new_clients, undos)
    for undo in undos:
        undo.commit()
    return specs


def _write_all(store: Path, specs: list[st.ShardSpec], src: ImportSource, arrays: list, cls: list[str],
               manifest_hash: str, root: dict | None, new_clients: list[str], undos: list[_Undo]) -> None:
    """Write every checked shard; on any failure undo what was written and re-raise."""
    recorded: set[Path] = set()
    try:
        for n, (spec, item, (feats, _, _)) in enumerate(zip(specs, src.items, arrays)):
            undos.append(_Undo(store, st.backbone_key(spec.backbone), spec.client, spec.split, spec.key, recorded))
            if n == 0:
                st.init_store(store, cls, manifest_hash, clients=new_clients if root is None else None,
                              source=f"import:{src.name}" if root is None else None)
                st.add_clients(store, new_clients)  # one write of the root's client list
            views = None if item.views is None else item.views.astype(np.float32)
            st.write_shard(store, spec, feats, views, item.mask, names_checked=True)
        st.consolidate(store)
    except BaseException:
        for undo in reversed(undos):
            undo.undo()
        raise


def import_features(store: str | Path, file: str | Path, *, backbone: str, client: str, split: str,
                    domain: str | None = None, features_key: str = "features", labels_key: str = "labels",
                    transpose: bool = False, classes: Sequence[str] | None = None, dtype: str | None = None,
                    chunk_rows: int = st.DEFAULT_CHUNK_ROWS) -> st.ShardSpec:
    """Write one file's features (computed elsewhere) as a normal complete shard (weights_sha256 =
    the file's sha256). The shard joins the store's current manifest (its manifest_hash is the
    root's); a new store takes the file's sha256 as its manifest_hash."""
    specs = import_many(store, file, backbone=backbone, client=client, split=split, domain=domain,
                        features_key=features_key, labels_key=labels_key, transpose=transpose, classes=classes,
                        dtype=dtype, chunk_rows=chunk_rows)
    return specs[0]
