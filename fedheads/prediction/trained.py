"""What the classifier (fedheads.prediction.predict) and the extraction of new images
(fedheads.prediction.inputs) share: one shard of samples to classify and the note line. The
trained run itself is fedheads.run.saved.Trained."""

from __future__ import annotations

import sys
from dataclasses import dataclass


def note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Part:
    """One shard of samples to classify: `store_client`'s `split`, by each of `by` (run clients;
    None = the global model). `labelled`: the stored labels are true labels (else -1 is written)."""

    store_client: str
    split: str
    by: tuple[str | None, ...]
    labelled: bool = True
