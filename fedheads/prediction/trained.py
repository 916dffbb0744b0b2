"""What classifying needs from a trained run, shared by the classifier (fedheads.prediction.predict)
and the extraction of new images (fedheads.prediction.inputs): the run's algorithm and states, one
shard of samples to classify, and the backbone identity features must share with training's."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from embedcache.errors import UserError

IDENTITY = ("dim", "weights_sha256", "preprocess")  # what a backbone's features must share with training's


def note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr, flush=True)


@dataclass
class Trained:
    """What classifying needs from a trained run: the algorithm and one seed's final states."""

    alg: Any
    client_state: Any  # client axis over `clients`
    server_state: Any
    clients: list[str]
    classes: list[str]  # class names (str(i) when the run recorded none: numpy arrays)
    backbones: list[str]
    fingerprint: dict[str, Any] | None  # config.json's store_fingerprint
    binarize: bool
    device: torch.device
    dim: int  # D of the concatenated features

    def client_index(self, client: str) -> int:
        if client not in self.clients:
            raise UserError(f"--client {client}: not a client of this run (clients: {', '.join(self.clients)})")
        return self.clients.index(client)


@dataclass(frozen=True)
class Part:
    """One shard of samples to classify: `store_client`'s `split`, by each of `by` (run clients;
    None = the global model). `labelled`: the stored labels are true labels (else -1 is written)."""

    store_client: str
    split: str
    by: tuple[str | None, ...]
    labelled: bool = True


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
