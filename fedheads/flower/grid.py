"""A Flower Grid that counts and records what the server sends and receives (it changes nothing).

Every reply's records are logged by name and key (never values) with the bytes Flower moved,
so a run can show what the server saw: under SecAgg+ the secure fields never appear in a reply
in the clear, only Flower's masked vectors (`masked_parameters`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedheads.flower.codec import wire_bytes


def describe_content(msg: Message) -> dict[str, Any]:
    """Names of the records in a message and their keys (no values)."""
    c = msg.content if not msg.has_error() else None
    if c is None:
        return {"error": str(msg.error.reason)[:200]}
    return {"arrays": {k: sorted(v.keys()) for k, v in c.array_records.items()},
            "configs": {k: sorted(v.keys()) for k, v in c.config_records.items()},
            "metrics": {k: sorted(v.keys()) for k, v in c.metric_records.items()}}


class AuditGrid(Grid):
    """Delegates to `inner`; counts bytes per direction and logs every reply's record names."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner
        self.sent_bytes = 0
        self.received_bytes = 0
        self.received: list[dict[str, Any]] = []

    def set_run(self, run_id: Any) -> None:
        self.inner.set_run(run_id)

    @property
    def run(self) -> Any:
        return self.inner.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:
        return self.inner.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        self.sent_bytes += sum(wire_bytes(m) for m in msgs)
        return self.inner.push_messages(msgs)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._record(self.inner.pull_messages(message_ids))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        msgs = list(messages)
        self.sent_bytes += sum(wire_bytes(m) for m in msgs)
        return self._record(self.inner.send_and_receive(msgs, timeout=timeout))

    def _record(self, replies: Iterable[Message]) -> list[Message]:
        out = list(replies)
        for m in out:
            if not m.has_error():
                self.received_bytes += wire_bytes(m)
            self.received.append({"type": m.metadata.message_type, "group": m.metadata.group_id,
                                  "node": int(m.metadata.src_node_id), **describe_content(m)})
        return out
