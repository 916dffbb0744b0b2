"""What `embedcache import` can read, as a list of shards to write (docs/contracts.md, section 4a):
one file of arrays, an `embedcache export` (.h5 file or npz directory), an HDF5 file with one group
per client, or a directory of per-client files. Nothing here touches a store."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from embedcache.errors import UserError
from embedcache.parsing import read_json
from embedcache.store.export import EXPORT_FORMAT, EXPORT_INDEX
from embedcache.store.layout import backbone_key

FILE_SUFFIXES = (".npz", ".h5", ".hdf5", ".mat")
_EXPORTS = (EXPORT_FORMAT, "embedcache/1")  # the root format of exports written before 4a
_SPLITS = ("train", "test")
_PER_CLIENT = re.compile(r"^(.+)[_.-](train|test)$")  # <client>_<split>.<ext>


@dataclass
class ImportItem:
    """One shard to import, as read (features in the file's dtype)."""

    origin: str  # for messages: "file.h5:/bk/c0/train"
    client: str
    split: str
    features: np.ndarray
    labels: np.ndarray
    sample_ids: np.ndarray | None = None
    backbone: str | None = None  # an export's; None: the --backbone given
    domain: str | None = None
    views: np.ndarray | None = None
    mask: np.ndarray | None = None
    modality: str = "image"
    token_shape: tuple[int, int] | None = None


@dataclass
class ImportSource:
    name: str  # the file or directory name (recorded as preprocess.imported_from)
    files: list[Path]  # every file read, in path order (their sha256s are the provenance)
    items: list[ImportItem] = field(default_factory=list)
    classes: list[str] | None = None  # an export's class list
    exported: bool = False


def _ids(raw: np.ndarray) -> np.ndarray:
    return np.array([x.decode() if isinstance(x, bytes) else str(x) for x in np.asarray(raw).reshape(-1).tolist()],
                    dtype=str)


def _arrays(path: Path) -> dict[str, np.ndarray]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        if suffix in (".h5", ".hdf5"):
            import h5py

            with h5py.File(path, "r") as f:
                return {k: f[k][()] for k in f.keys() if isinstance(f[k], h5py.Dataset)}
        if suffix == ".mat":
            from scipy.io import loadmat

            return {k: v for k, v in loadmat(str(path)).items() if not k.startswith("__")}
    except Exception as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    raise UserError(f"{path}: unsupported file type {suffix!r} (use {', '.join(FILE_SUFFIXES)})")


def _item(data: dict, origin: str, client: str, split: str, fkey: str = "features", lkey: str = "labels",
          transpose: bool = False, **extra) -> ImportItem:
    for key in (fkey, lkey):
        if key not in data:
            raise UserError(f"{origin}: no array {key!r} (has: {', '.join(sorted(data)) or 'none'})")
    feats = np.asarray(data[fkey])
    ids = _ids(data["sample_ids"]) if "sample_ids" in data else None
    return ImportItem(origin, client, split, feats.T if transpose else feats, np.asarray(data[lkey]).reshape(-1),
                      ids, views=data.get("views"), mask=data.get("mask"), **extra)


def _export_extra(attrs: dict, origin: str) -> dict:
    """Backbone, domain, modality and token shape from an exported shard's attributes."""
    def val(k: str):
        v = attrs.get(k)
        return json.loads(v) if isinstance(v, str) and k == "token_shape" else v

    if not attrs.get("backbone"):
        raise UserError(f"{origin}: exported shard without a backbone attribute")
    ts = val("token_shape")
    return {"backbone": str(attrs["backbone"]), "domain": attrs.get("domain"),
            "modality": str(attrs.get("modality", "image")), "token_shape": tuple(ts) if ts else None}


def _h5_groups(path: Path, split: str | None) -> ImportSource:
    import h5py

    src = ImportSource(path.name, [path])
    try:
        f = h5py.File(path, "r")
    except Exception as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    with f:
        fmt = f.attrs.get("format")
        if fmt in _EXPORTS:
            src.exported = True
            src.classes = list(json.loads(f.attrs["classes"]))
            for bk in f:
                for client in f[bk]:
                    for sp in f[bk][client]:
                        g, origin = f[bk][client][sp], f"{path}:/{bk}/{client}/{sp}"
                        data = {k: g[k][()] for k in g.keys()}
                        src.items.append(_item(data, origin, client, sp, **_export_extra(dict(g.attrs), origin)))
            return src
        for client in f:
            g = f[client]
            if not isinstance(g, h5py.Group):
                raise UserError(f"{path}:/{client}: expected one group per client (or top-level `features`)")
            if "features" in g:  # <client>/ holds the arrays itself
                if split is None:
                    raise UserError(f"{path}:/{client}: holds one split's arrays; give --split")
                src.items.append(_item({k: g[k][()] for k in g.keys()}, f"{path}:/{client}", client, split))
                continue
            for sp in g:
                if sp not in _SPLITS or not isinstance(g[sp], h5py.Group):
                    raise UserError(f"{path}:/{client}/{sp}: expected a train or test group")
                src.items.append(_item({k: g[sp][k][()] for k in g[sp].keys()}, f"{path}:/{client}/{sp}", client, sp))
    return src


def _export_dir(path: Path) -> ImportSource:
    index = read_json(path / EXPORT_INDEX)
    if not isinstance(index, dict) or index.get("format") not in _EXPORTS:
        got = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise UserError(f"{path / EXPORT_INDEX}: format {got!r} is not {EXPORT_FORMAT}")
    src = ImportSource(path.name, [path / EXPORT_INDEX], classes=list(index["classes"]), exported=True)
    for key, attrs in sorted(index["shards"].items()):
        bk, client, sp = key.split("/")
        f = path / f"{key}.npz"
        if not f.is_file():
            raise UserError(f"{f}: listed in {EXPORT_INDEX} but missing")
        src.files.append(f)
        src.items.append(_item(_arrays(f), str(f), client, sp, **_export_extra(attrs, str(f))))
    return src


def _client_files(path: Path, fkey: str, lkey: str, transpose: bool) -> ImportSource:
    """<client>/<split>.<ext> or <client>_<split>.<ext>; anything else is an error naming it."""
    found: list[tuple[Path, str, str]] = []
    for p in sorted(path.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            for q in sorted(p.iterdir()):
                if q.stem not in _SPLITS or q.suffix.lower() not in FILE_SUFFIXES:
                    raise UserError(f"{q}: expected <client>/<train|test>.<npz|h5|mat> in {path}")
                found.append((q, p.name, q.stem))
            continue
        m = _PER_CLIENT.match(p.stem)
        if m is None or p.suffix.lower() not in FILE_SUFFIXES:
            raise UserError(f"{p}: expected <client>_<train|test>.<npz|h5|mat> (or <client>/<split>.<ext>) in {path}")
        found.append((p, m.group(1), m.group(2)))
    if not found:
        raise UserError(f"{path}: no per-client files (<client>_<split>.npz or <client>/<split>.npz)")
    src = ImportSource(path.name, [f for f, _, _ in found])
    src.items = [_item(_arrays(f), str(f), c, s, fkey, lkey, transpose) for f, c, s in found]
    return src


def read_source(path: str | Path, *, client: str | None, split: str | None, features_key: str = "features",
                labels_key: str = "labels", transpose: bool = False, backbone: str | None = None) -> ImportSource:
    """Every shard `path` holds; an export's shards of other backbones than `backbone` left out."""
    path = Path(path)
    if path.is_dir():
        if (path / EXPORT_INDEX).is_file():
            src = _export_dir(path)
        else:
            src = _client_files(path, features_key, labels_key, transpose)
    elif not path.is_file():
        raise UserError(f"{path}: file not found")
    elif path.suffix.lower() in (".h5", ".hdf5") and features_key not in _arrays(path):
        src = _h5_groups(path, split)
    else:  # one shard's arrays
        if client is None or split is None:
            raise UserError(f"{path}: holds one shard's arrays; give --client and --split")
        src = ImportSource(path.name, [path], [_item(_arrays(path), str(path), client, split, features_key,
                                                     labels_key, transpose)])
        return src
    if client is not None:
        src.items = [i for i in src.items if i.client == client]
        if not src.items:
            raise UserError(f"{path}: no client {client!r} in it")
    if split is not None:
        src.items = [i for i in src.items if i.split == split]
        if not src.items:
            raise UserError(f"{path}: no {split} split in it")
    if src.exported and backbone is not None:
        have = sorted({str(i.backbone) for i in src.items})  # an export names every shard's backbone
        src.items = [i for i in src.items if backbone in (i.backbone, backbone_key(str(i.backbone)))]
        if not src.items:
            raise UserError(f"{path}: no backbone {backbone!r} in this export (has: {', '.join(have)})")
    if not src.items:
        raise UserError(f"{path}: no shards in it")
    return src
