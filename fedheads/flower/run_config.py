"""What the network did in a run over Flower (results.json `flower`); what the run is asked to do
is fedheads.run.commands.FlowerRunConfig. Plain data: importable without Flower."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FlowerLog:
    """What the network did, per round (results.json `flower`)."""

    rounds: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, int] = field(default_factory=dict)  # client -> Flower node id
