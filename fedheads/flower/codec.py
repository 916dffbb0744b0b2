"""One loss-free codec between fedheads' stacked trees and Flower records (contract 8).

A tree (client state, server state, broadcast or message: frozen dataclasses, dicts, tuples and
lists whose leaves are tensors or plain scalars) travels as two records under one name:

- ``ArrayRecord`` ``<name>``: every tensor leaf, in tree order, keyed "0", "1", ... Each leaf is
  a Flower ``Array`` made by ``Array.from_numpy_ndarray`` (``np.save`` bytes, no pickle), so
  dtype (bool, int64, float32, float64, ...), shape and every bit survive;
- ``ConfigRecord`` ``<name>.tree``: {"tree": JSON of the structure}: dataclass nodes name their
  type as "module:qualname" (only types defined under ``fedheads.`` are ever resolved, so a
  message cannot make the receiver import anything else), scalar leaves (bool, int, float, str,
  None) are stored in the JSON (Python's float repr round-trips exactly, NaN/inf included).

``decode(encode(t)) == t`` bit for bit, tensors land on the CPU (tests/test_flower_codec.py checks
every registered algorithm's four types)."""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.flower import require_flower

require_flower()

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects  # noqa: E402

TREE_SUFFIX = ".tree"
_SCALARS = (bool, int, float, str, type(None))


def _to_numpy(t: torch.Tensor, path: str) -> np.ndarray:
    if t.dtype in (torch.bfloat16,) or t.is_complex():
        raise UserError(f"{path}: dtype {t.dtype} has no loss-free numpy form")
    return t.detach().cpu().contiguous().numpy()


def _flatten(tree: Any, arrays: list[np.ndarray], path: str) -> Any:
    if isinstance(tree, torch.Tensor):
        arrays.append(_to_numpy(tree, path))
        return {"t": "a", "i": len(arrays) - 1}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        cls = type(tree)
        return {"t": "dc", "type": f"{cls.__module__}:{cls.__qualname__}",
                "f": {f.name: _flatten(getattr(tree, f.name), arrays, f"{path}.{f.name}")
                      for f in dataclasses.fields(tree)}}
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise UserError(f"{path}: only string dict keys can be encoded")
        return {"t": "dict", "items": [[k, _flatten(v, arrays, f"{path}[{k}]")] for k, v in tree.items()]}
    if isinstance(tree, (list, tuple)):
        return {"t": type(tree).__name__, "items": [_flatten(v, arrays, f"{path}[{i}]") for i, v in enumerate(tree)]}
    if isinstance(tree, _SCALARS):
        return {"t": "v", "v": tree}
    raise UserError(f"{path}: cannot encode a {type(tree).__name__} leaf")


def _resolve(name: str) -> type:
    module, _, qual = name.partition(":")
    if not (module == "fedheads" or module.startswith("fedheads.")) or not qual:
        raise UserError(f"record: type {name!r} is not a fedheads type")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise UserError(f"record: {name!r} is not a fedheads dataclass")
    return obj


def _build(node: Any, arrays: ArrayRecord) -> Any:
    kind = node["t"]
    if kind == "a":
        return torch.from_numpy(arrays[str(node["i"])].numpy().copy())  # np.load's buffer is read-only
    if kind == "dc":
        cls = _resolve(node["type"])
        vals = {k: _build(v, arrays) for k, v in node["f"].items()}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if set(vals) != set(fields):
            raise UserError(f"record: fields of {node['type']} differ from this version of fedheads")
        obj = cls(**{k: v for k, v in vals.items() if fields[k].init})
        for k, v in vals.items():
            if not fields[k].init:
                object.__setattr__(obj, k, v)
        return obj
    if kind == "dict":
        return {k: _build(v, arrays) for k, v in node["items"]}
    if kind in ("list", "tuple"):
        items = [_build(v, arrays) for v in node["items"]]
        return items if kind == "list" else tuple(items)
    if kind == "v":
        return node["v"]
    raise UserError(f"record: unknown node kind {kind!r}")


def encode(tree: Any, path: str = "tree") -> tuple[ArrayRecord, ConfigRecord]:
    """(ArrayRecord of the tensor leaves, ConfigRecord holding the structure as JSON)."""
    arrays: list[np.ndarray] = []
    structure = _flatten(tree, arrays, path)
    rec = ArrayRecord({str(i): Array.from_numpy_ndarray(a) for i, a in enumerate(arrays)})
    return rec, ConfigRecord({"tree": json.dumps(structure, separators=(",", ":"))})


def decode(arrays: ArrayRecord, structure: ConfigRecord) -> Any:
    """The tree `encode` was given, tensors on the CPU."""
    return _build(json.loads(str(structure["tree"])), arrays)


def put(content: RecordDict, name: str, tree: Any) -> None:
    """Store `tree` in `content` under `name` (ArrayRecord) and `name + ".tree"` (ConfigRecord)."""
    arrays, structure = encode(tree, name)
    content.array_records[name] = arrays
    content.config_records[name + TREE_SUFFIX] = structure


def take(content: RecordDict, name: str) -> Any:
    """The tree stored under `name` (UserError when it is missing)."""
    if name not in content.array_records or name + TREE_SUFFIX not in content.config_records:
        raise UserError(f"record: {name!r} is missing from the message")
    return decode(content.array_records[name], content.config_records[name + TREE_SUFFIX])


def has(content: RecordDict, name: str) -> bool:
    return name in content.array_records and name + TREE_SUFFIX in content.config_records


def wire_bytes(obj: Any) -> int:
    """Bytes of every object Flower transfers for `obj` (a Message or a RecordDict): the sum of
    the serialised (deflated) objects of its object tree, metadata and headers included."""
    return sum(len(o.deflate()) for o in get_all_nested_objects(obj).values())
