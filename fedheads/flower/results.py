"""The run directory of a Flower run: the `fedheads train` contract (docs/contracts.md 6) plus a
`flower` block, written by the ServerApp (results.json last). Client states never leave the
nodes, so `state/` holds the server state only (`seed<S>.server.pt`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from fedheads.core.tree import tree_leaves
from fedheads.report import results as report

SERVER_STATE_FORMAT = "fedheads-flower-server-state/1"


def server_state_blob(server_state: Any) -> dict[str, Any]:
    """What state/seed<S>.server.pt holds: the server state's tensor leaves, sealed with their digest."""
    from fedheads.run.checkpoint import sealed

    return sealed({"format": SERVER_STATE_FORMAT, "server": [t.detach().cpu() for t in tree_leaves(server_state)]})


def write_run(cfg: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Write cfg.out/{config.json, metrics.csv, summary.md, plots, state/, results.json}."""
    from fedheads.run.environment import machine
    from fedheads.run.rundir import RunDir, config_dict
    from fedheads.run.train import environment, write_run_files

    res, names, desc = out["result"], out["names"], out["desc"]
    n_test = [int(d["n_test"]) for d in desc]
    per_seed = [report.seed_result_from_run(res, cfg.seed, names, n_test=n_test)]
    # a node that dropped out of the last evaluation has test samples but no accuracy: filed as
    # dropped, not as a client without test samples (the mean is over the nodes that evaluated)
    last_eval = [r for r in out["log"].rounds if "eval_dropped" in r and r["round"] == len(res.history)]
    gone = set(last_eval[-1]["eval_dropped"]) if last_eval else set()
    dropped = [c for c in per_seed[0]["clients_without_test"] if c in gone and n_test[names.index(c)] > 0]
    per_seed[0]["clients_without_test"] = [c for c in per_seed[0]["clients_without_test"] if c not in dropped]
    dims = [int(v["dim"]) for v in json.loads(str(desc[0]["backbones"])).values()]
    flog = out["log"]
    extra = {"training_rounds": cfg.rounds - out["collect_rounds"], "clients": names,
             "domains": [str(d["domain"]) for d in desc], "num_classes": int(desc[0]["num_classes"]),
             "feature_dim": int(desc[0]["dim"]), "engine": res.engine, "fraction": cfg.fraction,
             "flower": {"secagg": cfg.secagg, "nodes": flog.nodes, "rounds": flog.rounds,
                        "on_dropout": cfg.on_dropout,
                        "sent_bytes": sum(r["sent_bytes"] for r in flog.rounds),
                        "received_bytes": sum(r["received_bytes"] for r in flog.rounds)}}
    if out.get("notes"):  # AlgorithmBase.trained_notes
        extra["notes"] = out["notes"]
    if out.get("privacy") is not None:  # the block `fedheads train --dp-*` writes (fedheads.privacy)
        extra["privacy"] = out["privacy"]
    final = res.history[-1].accuracy or {}
    extra["other_rules"] = {k: {"mean": float(100 * v[~v.isnan()].mean()), "values": [float(100 * v[~v.isnan()].mean())]}
                            for k, v in final.items() if k != "main"}
    if "global_model" in extra["other_rules"]:
        extra["global_model_accuracy"] = extra["other_rules"]["global_model"]
    extra["timing"] = report.timing_block(per_seed, res.wall_seconds, res.cpu_seconds, machine(torch.device("cpu")), None)
    result = report.summarise_runs(per_seed, algorithm=cfg.algorithm, backbones=cfg.backbone_list(), rounds=cfg.rounds,
                                   feature_dims=dims, num_classes=int(desc[0]["num_classes"]), fraction=cfg.fraction,
                                   extra=extra)
    # bytes as sent over the network (every record Flower serialised, SecAgg+ stages included), not
    # the engine's count of the values in the clear (0 uploaded under SecAgg+: its sums go masked)
    result["communication"]["upload_bytes_total"] = float(extra["flower"]["received_bytes"])
    result["communication"]["download_bytes_total"] = float(extra["flower"]["sent_bytes"])
    for c in dropped:  # still listed: a client never silently leaves a report
        result["per_client"][c] = {"mean": None, "std": None, "n_test": n_test[names.index(c)], "dropped": True}
    result["per_client"] = dict(sorted(result["per_client"].items()))
    result["clients_dropped"] = dropped
    rd = RunDir(cfg.out).begin(cfg.overwrite)  # the refusals: before the run started (fedheads.flower.server)
    rd.save_state(f"state/seed{cfg.seed}.server.pt", server_state_blob(out["server_state"]))
    config = {"flower": dataclasses.asdict(cfg), "algorithm": cfg.algorithm, "backbones": cfg.backbone_list(),
              "algorithm_kwargs": out["kwargs"], "algorithm_config": config_dict(out["algorithm_config"]),
              "environment": environment()}
    write_run_files(rd, result, config, report.metrics_rows(res, cfg.seed, names))
    return result
