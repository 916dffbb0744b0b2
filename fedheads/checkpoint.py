"""Per-round checkpoints, shared by head training (`fedheads train/compare --resume`) and the live
stages (`fedheads finetune/feddra --resume`): one file per (run directory, seed), replaced
atomically after every round, holding tensors and plain values only (torch.load(weights_only=True)).

Every file carries the run's settings (`config`, plain JSON values) and their hash; a file
written with other settings is refused with one line naming the settings that differ, so a
resumed run can only continue the run it belongs to. Since every random choice of the engines
and drivers is a pure function of (seed, round, client, ...), continuing from a checkpoint ends
exactly where an uninterrupted run ends."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.atomic import atomic_torch_save


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
    atomic_torch_save(path, blob)


def load_checkpoint(path: Path, fmt: str, config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint at `path` (UserError when it is unreadable, of another format, or written with
    other settings: the line names what differs)."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise UserError(f"{path}: not a readable checkpoint ({type(exc).__name__}); remove it "
                        "or run without --resume") from None
    if not isinstance(blob, dict) or blob.get("format") != fmt:
        raise UserError(f"{path}: not a {fmt} checkpoint")
    if blob.get("config_hash") != config_hash(config):
        saved = blob.get("config")
        what = config_diff(json.loads(saved), config) if isinstance(saved, str) else ""
        raise UserError(f"{path}: written by a run with other settings ({what or 'settings hash differs'}); "
                        "resume with the same settings, or start over with --overwrite")
    return blob
