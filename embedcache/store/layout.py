"""The store's on-disk layout (docs/contracts.md, section 4): its format tag, where a store's
groups live, the root metadata, who may change them, and the consolidated view of them. Shared by
the writer (`embedcache.store.writer`), the reader and the maintenance commands (`verify --repair`,
`gc`, `rm`).

Locks: a per-client directory lock serialises the writers of one client's shards; the store
directory's lock guards the root's zarr.json (its attributes and consolidated metadata).
Always take a client lock before the store lock, never the other way round.

Names are unique under str.casefold() within a store: `Caltech10` and `caltech10` would share
one directory on a case-insensitive file system, and zarr's consolidated metadata cannot nest
both (it sorts keys case-insensitively and groups them by parent, which then interleave).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr

from embedcache.atomic import write_text
from embedcache.errors import StoreWarning, UserError
from embedcache.manifest import check_client_name

STORE_FORMAT = "embedcache/1"


SPLITS = ("train", "test")


DROPPED = "client dropped by the latest manifest"


OLDER = "extracted under an older manifest"


# How to get a store's root metadata back when it is lost or damaged but its shards are intact.
REBUILD = ("`embedcache verify --repair {store}` rebuilds it from the intact shards (add --manifest "
           "with the manifest last extracted into it if it cannot recover the class names)")


_NOTED: set[str] = set()


def note(msg: str) -> None:
    """Warn once per process per message (zarr's catch_warnings blocks reset Python's own registry)."""
    if msg not in _NOTED:
        _NOTED.add(msg)
        warnings.warn(msg, StoreWarning, stacklevel=3)


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
    manifest_hash: str = ""  # manifest the shard was extracted (or imported) under
    stale: str = ""  # why the shard is not current (DROPPED or OLDER); "" when current
    modality: str = "image"  # attr `modality` ("image" for shards written before it existed)
    token_shape: tuple[int, int] | None = None  # (T, D) of a text token shard: rows T-major, with a mask
    map_shape: tuple[int, ...] | None = None  # (C, H, W) of an image cut map (preprocess.map_shape)
    weights_sha256: str = ""  # attr `weights_sha256`: the backbone's weights (an import: its file's)
    preprocess: str = ""  # attr `preprocess` as canonical JSON (an import: {"imported_from": ...})

    @property
    def current(self) -> bool:
        return not self.stale


def root_metadata(path: str | Path) -> dict:
    """The store root's zarr.json, parsed (UserError when there is no store or it is unreadable)."""
    p = Path(path) / "zarr.json"
    if not p.is_file():
        if holds_shards(p.parent):  # the root of a store whose shards are still there
            raise UserError(f"{p}: missing; {REBUILD.format(store=p.parent)}")
        raise UserError(f"{p.parent}: no feature store here (zarr.json missing)")
    try:
        meta = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        fix = REBUILD.format(store=p.parent) if holds_shards(p.parent) else "the metadata is lost"
        raise UserError(f"{p}: unreadable ({' '.join(str(exc).split())}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("node_type") != "group" or not isinstance(meta.get("attributes"), dict):
        raise UserError(f"{p}: not the metadata of a zarr group")
    return meta


def subgroups(d: str | os.PathLike[str]) -> list[str]:
    """Child directories that are zarr groups or arrays (have a zarr.json); others are not nodes."""
    try:
        entries = os.scandir(os.fspath(d))
        return sorted(e.name for e in entries if e.is_dir() and os.path.isfile(os.path.join(e.path, "zarr.json")))
    except OSError:
        return []


def has_subgroup(d: str | os.PathLike[str]) -> bool:
    """Whether `d` has a child node (stops at the first: a backbone of 10,000 clients costs one entry)."""
    try:
        with os.scandir(os.fspath(d)) as entries:
            return any(e.is_dir() and os.path.isfile(os.path.join(e.path, "zarr.json")) for e in entries)
    except OSError:
        return False


def disk_shard_paths(path: str | Path) -> set[str]:
    """`<backbone key>/<client>/<split>` of every shard group on disk (a directory listing, no zarr)."""
    p = Path(path)
    return {f"{b}/{c}/{s}" for b in subgroups(p) for c in subgroups(p / b) for s in subgroups(p / b / c)}


def holds_shards(d: Path) -> bool:
    """`d` looks like a store root: it holds <backbone>/<client>/<train|test> groups."""
    return any(p.rsplit("/", 1)[1] in SPLITS for p in disk_shard_paths(d))


def consolidated_entries(meta: dict) -> dict | str | None:
    """The flat {path: metadata} of the root's consolidated metadata; None when there is none,
    a string saying why when it cannot be used."""
    cm = meta.get("consolidated_metadata")
    if cm is None:
        return None
    entries = cm.get("metadata") if isinstance(cm, dict) else None
    return entries if isinstance(entries, dict) else "is unreadable"


def consolidated_problem(path: str | Path, meta: dict) -> str | None:
    """Why the root's consolidated metadata cannot stand for the hierarchy (None: it can, or
    there is none). Cheap: compares the shard groups it lists with the directories on disk."""
    entries = consolidated_entries(meta)
    if not isinstance(entries, dict):
        return entries
    bad = next((k for k, v in entries.items() if not isinstance(v, dict) or v.get("node_type") not in ("group", "array")),
               None)
    if bad is not None:  # the reader reads the entries as they are: each must be a node's metadata
        return f"is unreadable (its entry {bad} is not a node's metadata)"
    listed = {k for k, v in entries.items() if k.count("/") == 2 and isinstance(v, dict) and v.get("node_type") == "group"}
    disk = disk_shard_paths(path)
    if listed == disk:
        return None
    gone, new = sorted(listed - disk), sorted(disk - listed)
    return "is stale (" + "; ".join(
        ([f"lists {gone[0]}{f' and {len(gone) - 1} more' if len(gone) > 1 else ''}, gone from disk"] if gone else [])
        + ([f"misses {new[0]}{f' and {len(new) - 1} more' if len(new) > 1 else ''}"] if new else [])) + ")"


def stale_reason(root_attrs: dict, client: str, manifest_hash: str) -> str:
    """"" when a shard of `client` extracted under `manifest_hash` is current, else why not."""
    listed = root_attrs.get("clients")
    if listed is not None and client not in listed:
        return DROPPED
    if manifest_hash != root_attrs.get("manifest_hash"):
        return OLDER
    return ""


def zarr_root(path: str | Path, consolidated: bool) -> zarr.Group:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # consolidated metadata is not yet in the v3 spec
        return zarr.open_group(str(path), mode="r", zarr_format=3, use_consolidated=None if consolidated else False)


def open_group(path: str | Path, consolidated: bool) -> zarr.Group:
    """The store's root group, through its consolidated metadata or not (UserError when zarr fails)."""
    try:
        return zarr_root(path, consolidated)
    except Exception as exc:  # zarr raises many types for a damaged hierarchy
        raise UserError(f"{path}: cannot open the store ({type(exc).__name__}: {exc})") from None


class StoreNodes:
    """The metadata (zarr.json, parsed) of a store's nodes by path: from the root's consolidated
    metadata when the reader uses it (checked against the shard directories on disk), else each
    node's own file, read once when first asked. Reads need no zarr group: opening one parses the
    whole consolidated metadata into zarr objects, which grows with the shards (`root()` opens
    the hierarchy without it, for the arrays the direct reads do not handle)."""

    def __init__(self, path: str | Path, entries: dict[str, Any] | None = None) -> None:
        self.path = str(path)
        self.consolidated = entries is not None
        self._known: dict[str, Any] = entries if entries is not None else {}
        self._root: zarr.Group | None = None

    def get(self, key: str) -> dict[str, Any] | None:
        """The node's metadata; None when there is no such node or it is unreadable."""
        if key in self._known or self.consolidated:
            found = self._known.get(key)
        else:
            try:
                found = json.loads((Path(self.path) / key / "zarr.json").read_text())
            except (OSError, UnicodeDecodeError, ValueError):
                found = None
            self._known[key] = found
        return found if isinstance(found, dict) else None

    def attributes(self, key: str) -> dict[str, Any] | None:
        """A group's attributes; None when it is not a readable group."""
        meta = self.get(key)
        attrs = meta.get("attributes", {}) if meta is not None and meta.get("node_type") == "group" else None
        return attrs if isinstance(attrs, dict) else None

    def root(self) -> zarr.Group:
        """The store's root group, opened once, without the consolidated metadata."""
        if self._root is None:
            self._root = open_group(self.path, False)
        return self._root


BACKUP_PREFIX = ".import-backup-"  # a shard an import replaces waits here (no zarr.json: not a node)


def backbone_key(name: str) -> str:
    """Group name for a backbone: every character outside [A-Za-z0-9_.@-] becomes '_' ('@' of a cut stays)."""
    return "".join(c if (c.isascii() and (c.isalnum() or c in "_.-@")) else "_" for c in name)


def shard_path(store: str | Path, backbone: str, client: str, split: str) -> str:
    """Path of a shard group relative to the store root."""
    return f"{backbone_key(backbone)}/{client}/{split}"


_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _inside(path: str | bytes | os.PathLike, store: str | Path) -> bool:
    root = os.path.abspath(store)
    return os.path.commonpath([os.path.abspath(os.fsdecode(path)), root]) == root


@contextlib.contextmanager
def store_writes(store: str | Path, flag: str = "--store") -> Iterator[None]:
    """Turn a write that the file system refuses (disk full, no permission, read-only) into one
    line naming the path and what to do; any other OSError, and every other error, passes as is.
    What was written stays consistent either way (chunks are digested, imports roll back)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _FULL + _DENIED or (exc.filename and not _inside(exc.filename, store)):
            raise  # another error, or a file outside the store (a weights file, a cache): not the store's
        where = exc.filename or store
        what = os.strerror(exc.errno)
        if exc.errno in _FULL:
            raise UserError(f"{where}: cannot write ({what}); free space on that disk (or choose another {flag}) "
                            "and run the command again") from None
        todo = (f"the file system is read-only: choose another {flag}" if exc.errno == errno.EROFS
                else f"fix its permissions or choose another {flag}")
        raise UserError(f"{where}: cannot write ({what}); {todo}") from None


@contextlib.contextmanager
def dir_lock(path: str | Path) -> Iterator[None]:
    """Exclusive fcntl lock on a directory (never replaced, unlike zarr.json files), so two
    `extract` processes on one store serialise shard creation, finalisation and consolidation.
    Writing no lock file keeps the Zarr hierarchy free of foreign objects."""
    Path(path).mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


OpenMode = Literal["r", "r+", "a", "w", "w-"]


def attr(node: zarr.Group, key: str, default: Any = None) -> Any:
    """A group's attribute as the JSON it was written as (zarr types it as any JSON value)."""
    return node.attrs.get(key, default)


def array(group: zarr.Group, key: str) -> zarr.Array:
    """`group[key]` typed as the array a shard holds there; one clear line when it is a group."""
    found = group[key]
    if not isinstance(found, zarr.Array):
        raise UserError(f"{group.path}/{key}: a group where an array was expected")
    return found


def read(group: zarr.Group, key: str, selection: Any = Ellipsis) -> np.ndarray:
    """`group[key][selection]` as an ndarray (zarr types reads as array-or-scalar)."""
    return np.asarray(array(group, key)[selection])


def quiet_open(path: str | Path, mode: OpenMode = "r+", **kw) -> zarr.Group:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open_group(str(path), mode=mode, zarr_format=3, **kw)


def write_json_atomic(path: Path, obj: dict) -> None:
    write_text(path, json.dumps(obj, indent=2))


def drop_consolidated(store: str | Path, *, have_lock: bool = False) -> None:
    """A store about to change must not keep consolidated metadata that describes its past
    (readers open the consolidated view when there is one). Done under the store lock so a
    concurrent `consolidate` cannot write the old view back afterwards."""
    if not have_lock:
        with dir_lock(store):
            drop_consolidated(store, have_lock=True)
        return
    meta = root_metadata(store)
    if "consolidated_metadata" in meta:
        meta.pop("consolidated_metadata")
        write_json_atomic(Path(store) / "zarr.json", meta)


def has_consolidated(store: str | Path) -> bool:
    """Consolidated metadata is present and matches the shard groups on disk (a store whose
    metadata went stale or unreadable gets it rewritten at the next write)."""
    meta = root_metadata(store)
    return meta.get("consolidated_metadata") is not None and consolidated_problem(store, meta) is None


def consolidate(store: str | Path) -> None:
    """Consolidate the metadata of the whole store once, after all writes."""
    with dir_lock(store), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drop_consolidated(store, have_lock=True)  # zarr would otherwise parse a damaged one first
        zarr.consolidate_metadata(str(store))


def _nodes(root: Path, prefix: str = "") -> dict[str, Path]:
    """Every node below `root` (directories with a zarr.json), by path; arrays are not entered."""
    out: dict[str, Path] = {}
    for name in subgroups(root / prefix if prefix else root):
        key = f"{prefix}/{name}" if prefix else name
        out[key] = root / key / "zarr.json"
        try:
            kind = json.loads(out[key].read_text()).get("node_type")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind == "group":
            out.update(_nodes(root, key))
    return out


def consolidated_mismatch(store: str | Path) -> str | None:
    """How the consolidated metadata differs from the files (None: it matches, or there is
    none). Thorough: every node's zarr.json is compared, for `verify`."""
    entries = consolidated_entries(root_metadata(store))
    if not isinstance(entries, dict):
        return entries
    disk = _nodes(Path(store))
    for key in sorted(set(entries) | set(disk)):
        if key not in disk:
            return f"lists {key}, which is not on disk"
        if key not in entries:
            return f"misses {key}"
        try:
            on_disk = json.loads(disk[key].read_text())
        except (OSError, ValueError):
            return f"lists {key}, whose zarr.json is unreadable"
        listed = dict(entries[key]) if isinstance(entries[key], dict) else {}
        on_disk.pop("consolidated_metadata", None)
        listed.pop("consolidated_metadata", None)
        if on_disk != listed:
            return f"describes {key} differently from its zarr.json"
    return None


def folded(names: Iterable[str]) -> dict[str, list[str]]:
    """{casefolded name: the names that fold to it}: case collisions of many names in one pass."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(n.casefold(), []).append(n)
    return out


def case_collision(name: str, existing: Iterable[str]) -> str | None:
    """An existing name that differs from `name` only in letter case, if any."""
    folded = name.casefold()
    return next((e for e in existing if e != name and e.casefold() == folded), None)


def collides(kind: str, name: str, other: str, where: str = "existing ", hint: str = "") -> UserError:
    return UserError(f"{kind} {name}: collides with {where}{kind} {other} (names must differ in more than "
                     f"letter case{hint})")


def disk_clients(store: str | Path) -> set[str]:
    """Every client that has a group under some backbone of the store."""
    p = Path(store)
    return {c for b in subgroups(p) for c in subgroups(p / b)}


def check_client_names(store: str | Path, clients: Sequence[str]) -> None:
    """Refuse client names that cannot be a directory on every file system (manifest.client_name_problem)
    or that collide case-insensitively with each other or with a client already in the store
    (stale or not: it would share its directory)."""
    for c in clients:  # every name before anything is written (a bad one used to fail mid-way)
        check_client_name(c)
    seen: dict[str, str] = {}  # folded -> name: one pass, however many clients
    for c in clients:
        first = seen.setdefault(c.casefold(), c)
        if first != c:
            raise collides("client", c, first, where="")
    on_disk = folded(disk_clients(store)) if (Path(store) / "zarr.json").exists() else {}
    for c in clients:
        other = next((o for o in on_disk.get(c.casefold(), ()) if o != c), None)
        if other is not None:
            raise collides("client", c, other, hint=f"; `embedcache rm {store} --backbone B --client {other}` "
                                                    "removes the existing one")


def other_shards(store: str | Path, bk: str, skip: Iterable[tuple[str, str]] = ()) -> Iterator[tuple[str, dict]]:
    """(path, attributes) of every readable shard of backbone group `bk` but the (client, split)
    pairs in `skip` (those a write is about to replace)."""
    bdir, skipped = Path(store) / bk, set(skip)
    for client in subgroups(bdir):
        for split in subgroups(bdir / client):
            if (client, split) in skipped:
                continue
            a = read_attrs(bdir / client / split / "zarr.json")
            if "cache_key" in a:
                yield f"{bk}/{client}/{split}", a


def check_backbone_name(store: str | Path, backbone: str) -> None:
    """Refuse a backbone whose group would collide with another backbone's group."""
    bk, p = backbone_key(backbone), Path(store)
    if not bk:
        raise UserError(f"backbone {backbone!r}: empty name")
    groups = subgroups(p) if (p / "zarr.json").exists() else []
    other = case_collision(bk, groups)
    if other is not None:
        raise UserError(f"backbone {backbone}: its group {bk} collides with existing group {other} "
                        "(names must differ in more than letter case)")
    if bk in groups and has_subgroup(p / bk):
        try:
            held = json.loads((p / bk / "zarr.json").read_text()).get("attributes", {}).get("backbone", backbone)
        except (OSError, ValueError, AttributeError):
            held = backbone
        if held != backbone:
            raise UserError(f"backbone {backbone}: its group {bk} already holds backbone {held} (both names map "
                            "to it); use another name or store")


def read_attrs(path: Path) -> dict:
    try:
        a = json.loads(path.read_text()).get("attributes", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return a if isinstance(a, dict) else {}






