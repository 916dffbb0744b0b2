"""The server's round loop over a Flower Grid (see fedheads/flower/server.py for the policy)."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from flwr.app import Message, RecordDict  # noqa: E402  (after fedheads.flower: quiet env)

from embedcache.errors import UserError
from fedheads.core.engine import CommRecord, RoundRecord, RunResult, clock, select_participants
from fedheads.core.federation import DataSpec
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import payload_size, tree_cat
from fedheads.flower import codec
from fedheads.flower.deploy import round_line
from fedheads.flower.dp import node_mechanism, reported_releases
from fedheads.flower.messaging import failed_nodes, run_record, send
from fedheads.flower.run_config import FlowerLog
from fedheads.run.commands import FlowerRunConfig
from fedheads.run.saved import attach_saved_runs

log = logging.getLogger("fedheads.flower")


def build(cfg: FlowerRunConfig, noise_seed: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The server's algorithm (under the run's DP mechanism, with its own noise key, when asked
    for) and the kwargs of the algorithm it wraps (sent to every node)."""
    from fedheads.run.train import TrainOptions, build_algorithm

    opts = TrainOptions(settings=tuple((k, v) for k, v in json.loads(cfg.settings)),
                        local_epochs=cfg.local_epochs or None, batch_size=cfg.batch_size or None,
                        lr=cfg.lr or None, progress=False, dp=cfg.mechanism(noise_seed), seeds=(cfg.seed,))
    alg, kwargs, _ = build_algorithm(cfg.algorithm, opts, strict=True)
    return alg, kwargs


class Federation:
    """State of one run: the nodes in global client order and what every message carries."""

    def __init__(self, grid: Any, context: Any, cfg: FlowerRunConfig, order: list[tuple[int, dict[str, Any]]],
                 noise_seed: int | None = None) -> None:
        self.grid, self.context, self.cfg = grid, context, cfg
        self.node_ids = [n for n, _ in order]
        self.names = [str(d["client"]) for _, d in order]
        self.desc = [d for _, d in order]
        self.alg, self.kwargs = build(cfg, noise_seed)
        self.dp = node_mechanism(self.alg)  # what the nodes get of the mechanism (never a noise key)
        # the nodes agree on their classes and backbones (fedheads.flower.server): a saved run read must too
        attach_saved_runs(self.alg, str(self.desc[0]["classes"]), json.loads(str(self.desc[0]["backbones"])))
        self.releases = [0] * len(self.node_ids)  # under DP: each client's rounds with non-zero statistics
        if cfg.secagg:
            from fedheads.flower.secure import secure_form

            secure_form(self.alg)  # unsupported algorithm / aggregation: one line before round 0
        self.flog = FlowerLog(nodes=dict(zip(self.names, self.node_ids)))

    def run_json(self, i: int, r: int, part: list[int]) -> dict[str, Any]:
        return {"algorithm": self.cfg.algorithm, "kwargs": self.kwargs, "seed": self.cfg.seed, "round": r,
                "index": i, "num_clients": len(self.node_ids), "participants": part,
                "backbones": self.cfg.backbone_list(), "binarize": self.cfg.binarize, "secagg": self.cfg.secagg,
                "dp": self.dp}

    def message(self, i: int, r: int, part: list[int], kind: str, name: str, tree: Any) -> Message:
        content = RecordDict({"fh.run": run_record(self.run_json(i, r, part))})
        codec.put(content, name, tree)
        return Message(content, dst_node_id=self.node_ids[i], message_type=kind, group_id=str(r))

    def exchange(self, idx: list[int], r: int, part: list[int], kind: str, name: str, tree: Any,
                 what: str) -> tuple[dict[int, Message], list[int]]:
        """Send one message per client index; (replies by index, indices that failed)."""
        msgs = [self.message(i, r, part, kind, name, tree) for i in idx]
        replies = send(self.grid, msgs, self.cfg.timeout)
        bad = failed_nodes([self.node_ids[i] for i in idx], replies)
        failed = [i for i in idx if self.node_ids[i] in bad]
        for i in failed:
            note = f"round {r + 1}: {what}: node {self.names[i]} (id {self.node_ids[i]}) failed: {bad[self.node_ids[i]]}"
            if self.cfg.on_dropout == "refuse":
                raise UserError(note + "; the round's result would miss its contribution, so the run is refused "
                                "(on-dropout=continue completes rounds from the nodes that reply)")
            log.warning("%s; completing the round without it", note)
        by_index = {i: replies[self.node_ids[i]] for i in idx if i not in failed}
        if self.dp is not None and kind == "train.update":
            for i, m in by_index.items():
                self.releases[i] = reported_releases(m.content.config_records, self.names[i])
        return by_index, failed


def federate(grid: Any, context: Any, cfg: FlowerRunConfig, order: list[tuple[int, dict[str, Any]]],
             noise_seed: int | None = None) -> dict[str, Any]:
    fed = Federation(grid, context, cfg, order, noise_seed)
    alg, M = fed.alg, len(fed.node_ids)
    spec = DataSpec(int(fed.desc[0]["dim"]), int(fed.desc[0]["num_classes"]), M,
                    tuple(int(d["n_train"]) for d in fed.desc), torch.device("cpu"))
    dev = spec.device
    t_run = clock(dev)
    init = alg.init(spec, cfg.seed)
    ss, bc = init.server_state, init.broadcast
    res = RunResult(algorithm=alg.name, engine="flower-secagg" if cfg.secagg else "flower")
    res.trainable_params_per_client = alg.trainable_params(init.client_state)
    for r in range(cfg.rounds):
        t0, b0 = clock(dev), (grid.sent_bytes, grid.received_bytes)
        part = select_participants(M, cfg.fraction, cfg.seed, r).tolist()
        replies, dropped = fed.exchange(part, r, part, "train.update", "fh.broadcast", bc, "update")
        alive = [i for i in part if i in replies]
        if not alive:
            raise UserError(f"round {r + 1}: no node replied")
        ctx = RoundCtx(r, cfg.seed, torch.tensor(alive, dtype=torch.int64), M)
        up_v = up_b = 0
        if cfg.secagg:
            ss, bc, alive, extra = _secure_round(fed, ss, replies, alive, r, ctx)
            dropped += extra
        else:
            msgs = [codec.take(replies[i].content, "fh.message") for i in alive]
            msg = tree_cat(msgs)
            up_v, up_b = payload_size(msg, per_client=True)
            ss, bc = alg.server_aggregate(ss, msg, ctx)
        t1 = clock(dev)
        down_v, down_b = payload_size(bc, per_client=False)
        P = len(alive)
        acc, t2, eval_dropped = None, t1, []
        if cfg.evaluates(r + 1, cfg.rounds):
            acc, eval_dropped = _evaluate(fed, ss, r, part)
            t2 = clock(dev)
        res.history.append(RoundRecord(r, tuple(alive), CommRecord(up_v * P, up_b * P, down_v * P, down_b * P), acc,
                                       t1[0] - t0[0], t1[1] - t0[1], t2[0] - t1[0], t2[1] - t1[1]))
        res.upload_values_per_client = up_v
        fed.flog.rounds.append({"round": r + 1, "participants": [fed.names[i] for i in alive],
                                "dropped": [fed.names[i] for i in dropped],
                                "eval_dropped": [fed.names[i] for i in eval_dropped],
                                "sent_bytes": grid.sent_bytes - b0[0], "received_bytes": grid.received_bytes - b0[1],
                                "train_seconds": t1[0] - t0[0], "eval_seconds": t2[0] - t1[0]})
        log.info("%s", round_line(fed.flog.rounds[-1], cfg.rounds))
        _progress(cfg, fed.flog.rounds[-1])
    res.server_state = ss
    notes = alg.trained_notes(ss, [str(c) for c in range(int(fed.desc[0]["num_classes"]))])  # names: a hash only here
    t_end = clock(dev)
    res.wall_seconds, res.cpu_seconds = t_end[0] - t_run[0], t_end[1] - t_run[1]
    return {"result": res, "server_state": ss, "log": fed.flog, "names": fed.names, "desc": fed.desc,
            "kwargs": fed.kwargs, "algorithm_config": getattr(alg, "cfg", None),
            "collect_rounds": int(getattr(alg, "collect_rounds", 0)), "notes": notes,
            "privacy": None if fed.dp is None else alg.report([max(fed.releases, default=0)])}


def _progress(cfg: FlowerRunConfig, record: dict[str, Any]) -> None:
    """One line per finished round in OUT/progress.jsonl (a deployment's server runs elsewhere)."""
    if cfg.out:
        from pathlib import Path

        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        with open(Path(cfg.out) / "progress.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def _secure_round(fed: Federation, ss: Any, replies: dict[int, Message], alive: list[int], r: int,
                  ctx: RoundCtx) -> tuple[Any, Any, list[int], list[int]]:
    """The sums of the round's secure fields through SecAgg+, then the algorithm's server step."""
    from fedheads.flower.secure import SecAggConfig, dequantized_totals, secure_form, secure_sums

    exps: dict[str, int] = {}
    for i in alive:
        for k, e in dict(replies[i].content.config_records["fh.exponents"]).items():
            exps[k] = max(exps.get(k, -10**9), int(e))
    names = sorted(exps)
    scfg = SecAggConfig(fed.cfg.secagg_shares, fed.cfg.secagg_threshold, fed.cfg.timeout)
    arrays, contributors = secure_sums(fed.grid, fed.context, [fed.node_ids[i] for i in alive], names, exps, r, scfg)
    if arrays is None:
        raise UserError(f"round {r + 1}: SecAgg+ halted (too few nodes left for its reconstruction threshold)")
    got = [i for i in alive if fed.node_ids[i] in contributors]
    extra = [i for i in alive if i not in got]
    for i in extra:
        note = f"round {r + 1}: secure aggregation: node {fed.names[i]} (id {fed.node_ids[i]}) dropped out"
        if fed.cfg.on_dropout == "refuse":
            raise UserError(note + "; the secure sum misses its contribution, so the run is refused")
        log.warning("%s; SecAgg+ summed the others", note)
    has_clear = codec.has(replies[got[0]].content, "fh.message")
    clear = tree_cat([codec.take(replies[i].content, "fh.message") for i in got]) if has_clear else None
    form = secure_form(fed.alg, clear if clear is not None else None)
    totals = dequantized_totals(arrays, names, exps, form.integer, len(got))
    ctx = RoundCtx(r, ctx.seed, torch.tensor(got, dtype=torch.int64), ctx.num_clients)
    ss, bc = form.aggregate(ss, clear, totals, ctx)
    return ss, bc, got, extra


def _evaluate(fed: Federation, ss: Any, r: int, part: list[int]) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Per-client accuracy [M] per rule (NaN where a node dropped out under on-dropout=continue),
    and the indices of the nodes that did not evaluate."""
    M = len(fed.node_ids)
    replies, failed = fed.exchange(list(range(M)), r, part, "evaluate", "fh.server_state", ss, "evaluation")
    rules: dict[str, torch.Tensor] = {}
    for i, m in replies.items():
        for k, v in dict(m.content.metric_records["fh.accuracy"]).items():
            rules.setdefault(k, torch.full((M,), float("nan"), dtype=torch.float64))[i] = float(v)
    return rules, failed
