"""What makes two sets of features comparable: the same class names in the same order and, per
backbone, the same feature dimension, weights sha256 and preprocessing (a run's config.json
`store_fingerprint`, docs/contracts.md 6). `fedheads predict` checks a store against the run it
classifies with; training checks a saved run that an algorithm reads (CCVR's head=RUN_DIR)
against the store it trains on. Plain JSON, no torch."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from embedcache.errors import UserError

IDENTITY = ("dim", "weights_sha256", "preprocess")  # what a backbone's features must share with training's


def classes_hash(classes: Sequence[str]) -> str:
    """A short digest of a class list (what a Flower node reports instead of the names)."""
    return hashlib.sha256(json.dumps(list(classes)).encode()).hexdigest()[:16]


def mismatch(backbone: str, recorded: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """None when `now` has the identity (dim, weights sha256, preprocessing) training's features
    had; else what differs, for a one-line error naming the backbone."""
    norm = lambda v: json.loads(json.dumps(v))  # noqa: E731 - tuples vs the JSON lists stores give back
    for key in IDENTITY:
        a, b = norm(recorded.get(key)), norm(now.get(key))
        if a == b:
            continue
        if key == "preprocess" and isinstance(a, dict) and isinstance(b, dict):
            diff = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            return (f"backbone {backbone}: preprocessing differs from the training run's "
                    f"({', '.join(f'{k} {a.get(k)!r} -> {b.get(k)!r}' for k in diff[:3])})")
        what = {"dim": "feature dimension", "weights_sha256": "weights (sha256)"}.get(key, key)
        shown = (lambda v: str(v)[:12]) if key == "weights_sha256" else str
        return f"backbone {backbone}: {what} differs from the training run's ({shown(a)} -> {shown(b)})"
    return None


def _shown(names: Sequence[str]) -> str:
    return ",".join(names[:6]) + (f",... ({len(names)})" if len(names) > 6 else "")


def check_saved_run(where: str, run_dir: str | Path, classes: Sequence[str] | str | None,
                    backbones: Mapping[str, Mapping[str, Any]] | None) -> None:
    """A saved run that an algorithm reads (`where`: the setting naming it, e.g. head=RUN_DIR) was
    trained on features of this run's classes (names, in order; or their `classes_hash`) and
    backbones ({name: identity}, a store fingerprint's `backbones`); UserError in one line naming
    what differs. Runs trained from numpy arrays record no fingerprint: nothing to compare (the
    algorithm still checks feature size and class count); the same when this run's `classes` is None."""
    path = Path(run_dir) / "config.json"
    try:
        saved = json.loads(path.read_text()).get("store_fingerprint")
    except FileNotFoundError:
        raise UserError(f"{where}: {run_dir} is not a fedheads run directory (no config.json)") from None
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{where}: {path}: unreadable ({type(e).__name__})") from None
    if not isinstance(saved, dict) or classes is None or backbones is None:
        return
    theirs = list(saved.get("classes") or [])
    same = classes == classes_hash(theirs) if isinstance(classes, str) else list(classes) == theirs
    if not same:
        ours = "another class list" if isinstance(classes, str) else f"classes {_shown(list(classes))}"
        raise UserError(f"{where}: that run was trained on classes {_shown(theirs)}, this run has {ours}; "
                        "its head would score the wrong classes (train the head on this store)")
    saved_b = dict(saved.get("backbones") or {})
    if list(saved_b) != list(backbones):
        raise UserError(f"{where}: that run was trained on backbones {','.join(saved_b)}, this run on "
                        f"{','.join(backbones)}; train the head on this store's features")
    for b, now in backbones.items():
        msg = mismatch(b, saved_b[b], now)
        if msg:
            raise UserError(f"{where}: {msg.replace('the training run', 'this run')}; train the head on this store's features")
