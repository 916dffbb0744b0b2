"""Per-round checkpoints, shared by head training (`fedheads train/compare --resume`) and the live
stages (`fedheads finetune/feddra --resume`): one file per (run directory, seed), replaced
atomically after every round, holding tensors and plain values only (torch.load(weights_only=True)).

Every file carries the run's settings (`config`, plain JSON values) and their hash; a file
written with other settings is refused with one line naming the settings that differ, so a
resumed run can only continue the run it belongs to. Since every random choice of the engines
and drivers is a pure function of (seed, round, client, ...), continuing from a checkpoint ends
exactly where an uninterrupted run ends.

Every state file fedheads writes (these checkpoints, a run's final `state/seed<S>.pt`, a Flower
run's server state) is sealed: it carries `digest`, the sha256 of every other value in it (tensors
by name, dtype, shape and bytes; plain values as JSON), and every load checks it, as the store
checks each chunk against its digest. A file that fails is one line naming it, never used; a file
written before states carried a digest is used with a one-line note, since there is nothing to
check it against and refusing it would only strand the runs made before."""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from embedcache.errors import UserError
from embedcache.tensor_digest import state_dict_sha256
from fedheads.run.atomic import atomic_torch_save

DIGEST = "digest"  # the key of a state file's seal
_NOTED: set[str] = set()


def _leaves(obj: Any, name: str, tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    if isinstance(obj, torch.Tensor):
        tensors[name] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leaves(v, f"{name}/{k}", tensors, plain)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leaves(v, f"{name}/{i}", tensors, plain)
    else:
        plain[name] = obj


def state_digest(blob: dict[str, Any]) -> str:
    """sha256 (hex) of everything in `blob` but its seal: the tensors by path, dtype, shape and
    bytes in sorted path order (`state_dict_sha256`, the backbones' weights identity), the plain
    values (rounds, history, settings, flags) as one more entry, compact JSON with sorted paths."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    _leaves({k: v for k, v in blob.items() if k != DIGEST}, "", tensors, plain)
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"), default=repr).encode()
    tensors["\0plain"] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return state_dict_sha256(tensors)


def save_sealed(path: Path, blob: dict[str, Any]) -> None:
    """`blob` with its digest, written atomically to `path`."""
    atomic_torch_save(path, {**blob, DIGEST: state_digest(blob)})


def load_sealed(path: Path, fmt: str, remedy: str) -> dict[str, Any]:
    """The `fmt` file at `path`, its digest checked; UserError naming the file (ending in `remedy`,
    what to do) when it is unreadable, not a `fmt` file, or corrupt."""
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol warning would be a second line
            warnings.simplefilter("ignore", UserWarning)
            blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, a pickle of other objects, not a torch file at all
        raise UserError(f"{path}: not a readable {fmt} file ({type(exc).__name__}); {remedy}") from None
    if not isinstance(blob, dict) or blob.get("format") != fmt:
        raise UserError(f"{path}: not a {fmt} file; {remedy}")
    if DIGEST not in blob:
        if str(path) not in _NOTED:
            _NOTED.add(str(path))
            print(f"note: {path}: written before state files carried a digest, so it is used unchecked",
                  file=sys.stderr, flush=True)
        return blob
    if blob[DIGEST] != state_digest(blob):
        raise UserError(f"{path}: corrupt (its contents do not match the digest written with them); {remedy}")
    return blob


def config_hash(config: Any) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def config_diff(saved: dict[str, Any], now: dict[str, Any], most: int = 3) -> str:
    """'key: saved -> now' for the first `most` settings that differ (dotted keys), '' if none."""
    a, b = _flat(json.loads(json.dumps(saved, default=str))), _flat(json.loads(json.dumps(now, default=str)))
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))
    parts = [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in keys[:most]]
    return "; ".join(parts) + (f" (and {len(keys) - most} more)" if len(keys) > most else "")


def save_checkpoint(path: Path, fmt: str, config: dict[str, Any], round_: int, payload: dict[str, Any],
                    history: list[dict[str, Any]]) -> None:
    """Write `payload` (tensors, lists and dicts of them, plain values) atomically to `path`."""
    blob = {"format": fmt, "config_hash": config_hash(config), "config": json.dumps(config, sort_keys=True,
                                                                                     default=str),
            "round": int(round_), "history": history, **payload}
    save_sealed(path, blob)


def load_checkpoint(path: Path, fmt: str, config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint at `path` (UserError when it is unreadable, of another format, or written with
    other settings: the line names what differs)."""
    blob = load_sealed(path, fmt, "start the run over with --overwrite, or delete it and --resume to train only this seed again")
    if blob.get("config_hash") != config_hash(config):
        saved = blob.get("config")
        what = config_diff(json.loads(saved), config) if isinstance(saved, str) else ""
        raise UserError(f"{path}: written by a run with other settings ({what or 'settings hash differs'}); "
                        "resume with the same settings, or start over with --overwrite")
    return blob
