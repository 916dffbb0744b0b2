"""What classifying needs from a trained run, shared by the classifier (fedheads.prediction.predict)
and the extraction of new images (fedheads.prediction.inputs): the run's algorithm and states, one
shard of samples to classify, and the backbone identity features must share with training's."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from embedcache.errors import UserError


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
