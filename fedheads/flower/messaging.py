"""Sending messages to Flower nodes and reading their failures (shared by the ServerApp's setup
and its round loop)."""

from __future__ import annotations

import json
from typing import Any

from fedheads.flower import require_flower

require_flower()

from flwr.app import ConfigRecord, Message  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402


def send(grid: Grid, msgs: list[Message], timeout: float) -> dict[int, Message]:
    replies = grid.send_and_receive(msgs, timeout=timeout)
    return {int(m.metadata.src_node_id): m for m in replies}


def failed_nodes(sent: list[int], replies: dict[int, Message]) -> dict[int, str]:
    out = {}
    for n in sent:
        m = replies.get(n)
        if m is None:
            out[n] = "no reply before the timeout (node gone?)"
        elif m.has_error():
            out[n] = " ".join(f"error {m.error.code}: {m.error.reason}".split())[:300]  # one line
    return out


def run_record(run: dict[str, Any]) -> ConfigRecord:
    return ConfigRecord({"json": json.dumps(run)})
