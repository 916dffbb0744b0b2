"""The ServerApp (`fedheads.flower.server:app`): the engine's round loop over the network.

Per round: the seeded participants (`select_participants`, as the engines) each get the
broadcast and run `client_update` on their own node (M=1); the server stacks the replies in
participant order and calls the algorithm's own `server_aggregate` (under SecAgg+ the secure
totals go through `secure.SecureForm.aggregate`, which calls it too). In the rounds the run's
schedule names (--eval-every: fedheads.core.schedule), every node evaluates its test split with
the current server state.

A node that fails a round (dies, errors, misses the timeout) is reported by name. `on_dropout`:
"refuse" (default) stops the run with one line naming the node and the round and writes no
results.json: an aggregate missing a client would silently differ from the federation asked
for. "continue" completes the round from the nodes that replied (ctx.participants = them) and
records the dropped nodes per round in results.json (`flower.rounds[].dropped`).

With dp_* in the run config the algorithm runs under fedheads.privacy's Gaussian mechanism, split
between the server and the nodes as fedheads/flower/dp.py describes."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from embedcache.errors import UserError
from embedcache.store.reader import identity_conflict
from fedheads.flower import require_flower

require_flower()

from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedheads.flower.grid import AuditGrid  # noqa: E402
from fedheads.flower.messaging import failed_nodes, run_record, send  # noqa: E402
from fedheads.flower.run_config import FlowerLog  # noqa: E402,F401 (re-exported)
from fedheads.run.commands import DROPOUT_POLICIES, FlowerRunConfig  # noqa: E402,F401 (re-exported)

log = logging.getLogger("fedheads.flower")
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_federation(grid, context, FlowerRunConfig.from_run_config(context.run_config))


def wait_for_nodes(grid: Grid, n: int, wait: float) -> list[int]:
    t0 = time.monotonic()
    while True:
        nodes = sorted(int(i) for i in grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        if time.monotonic() - t0 > wait:
            raise UserError(f"flower: {len(nodes)} of {n} nodes connected after {wait:.0f} s")
        time.sleep(0.2)


def describe_nodes(grid: Grid, nodes: list[int], cfg: FlowerRunConfig) -> list[tuple[int, dict[str, Any]]]:
    """[(node id, description)] in global client order; nodes must agree on classes and features."""
    run = {"backbones": cfg.backbone_list(), "binarize": cfg.binarize}
    msgs = [Message(RecordDict({"fh.run": run_record(run)}), dst_node_id=n, message_type="query.describe")
            for n in nodes]
    replies = send(grid, msgs, cfg.timeout)
    bad = failed_nodes(nodes, replies)
    if bad:
        n, why = next(iter(bad.items()))
        raise UserError(f"flower: node {n} could not describe its data: {why}")
    desc = [(n, dict(replies[n].content.config_records["fh.describe"])) for n in nodes]
    for key in ("dim", "num_classes", "classes"):
        vals = {str(d[key]) for _, d in desc}
        if len(vals) > 1:
            raise UserError(f"flower: nodes disagree on {key} ({', '.join(sorted(vals))[:200]})")
    _same_backbones(desc)
    names = [str(d["client"]) for _, d in desc]
    if len(set(names)) != len(names):
        raise UserError(f"flower: two nodes are the same client ({', '.join(sorted(names))})")
    order = [c.strip() for c in cfg.clients.split(",") if c.strip()] or sorted(names)
    if sorted(order) != sorted(names):
        raise UserError(f"clients {cfg.clients!r}: the nodes are {', '.join(sorted(names))}")
    by_name = {str(d["client"]): (n, d) for n, d in desc}
    return [by_name[c] for c in order]


def _same_backbones(desc: list[tuple[int, dict[str, Any]]]) -> None:
    """Every node extracted with the same weights and preprocessing (features from different
    weights would be averaged silently); the same rule as training on one store
    (embedcache.store.reader.identity_conflict): imports of different files may share a name, an
    import beside extracted features may not."""
    fps = [(str(d["client"]), json.loads(str(d["backbones"]))) for _, d in desc]
    for b in fps[0][1]:
        pair = identity_conflict([(c, fp[b]["weights_sha256"], fp[b]["preprocess"]) for c, fp in fps])
        if pair is not None:
            raise UserError(f"flower: backbone {b}: nodes {pair[0]} and {pair[1]} extracted with different weights or "
                            "preprocessing (or one imported its features)")


def run_federation(grid: Grid, context: Context, cfg: FlowerRunConfig, noise_seed: int | None = None) -> dict[str, Any]:
    """The whole run; returns {"result": RunResult, "server_state", "log": FlowerLog, ...}.
    `noise_seed`: the server's DP noise key (simulation only; None: a secret one from the OS)."""
    from fedheads.flower.loop import federate
    from fedheads.run import rundir

    if cfg.out:
        rundir.refuse_existing(Path(cfg.out), overwrite=cfg.overwrite)
    audit = AuditGrid(grid)
    try:
        nodes = wait_for_nodes(audit, cfg.nodes, cfg.wait)
        out = federate(audit, context, cfg, describe_nodes(audit, nodes, cfg), noise_seed)
    except UserError as e:  # reported where the run would have been, never a partial run directory
        if cfg.out:
            rundir.RunDir(cfg.out).write_text("failed.json", json.dumps({"error": str(e)}) + "\n")
        raise
    out["audit"] = audit.received
    if cfg.out:  # what the server received, by record name and key (no values): contract 8
        rundir.RunDir(cfg.out).write_text("received.jsonl", "".join(json.dumps(a) + "\n" for a in audit.received))
        from fedheads.flower.results import write_run

        write_run(cfg, out)
    return out
