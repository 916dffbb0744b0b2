"""From the cells of one arm (point x method) to the numbers a paper's table prints.

`aggregate` summarises the seeds with fedheads' own results contract (fedheads.report.results.summarise_runs:
client average within a seed, then mean and sample std over seeds); `values` reads each metric of
the experiment's layout from it. A metric we cannot measure in our setting is absent (shown "-").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedheads.report import metrics as fm
from fedheads.report import results as report

HEADERS = {
    "acc": "Acc", "comm_params": "# of Comm Params", "train_params": "# of Training Params",
    "fixed_params": "# of Fixed Params", "average": "Average", "worst_10": "Worst 10%", "worst_20": "Worst 20%",
    "worst_40": "Worst 40%", "best_10": "Best 10%", "variance": "Variance", "compute_F": "Total Compute (xF)",
    "comm_GB": "Total Comm. (GB)", "rsna_cls_1": "RSNA cls 1%", "rsna_cls_10": "RSNA cls 10%",
    "covid_cls_1": "Covid cls 1%", "covid_cls_10": "Covid cls 10%", "rsna_seg_1": "RSNA seg 1%",
    "rsna_seg_10": "RSNA seg 10%", "r1": "Rec.@1", "r5": "Rec.@5", "wst_r1": "Wst.@1", "wst_r5": "Wst.@5",
    "disparity": "Disparity", "acc_pooled": "Acc (pooled test)", "up_values": "Values sent up / client / round",
    "round_s": "Seconds / round",
}
COUNTS = ("comm_params", "train_params", "fixed_params", "up_values")  # printed as integers, no spread
SCIENTIFIC = ("compute_F", "comm_GB")


def header(metric: str) -> str:
    return metric.split(":", 1)[1] if metric.startswith("domain:") else HEADERS.get(metric, metric)


def aggregate(records: Sequence[dict[str, Any]], algorithm: str, backbones: Sequence[str], rounds: int,
              fraction: float) -> dict[str, Any] | None:
    """summarise_runs over the finished cells of one arm (None when none finished)."""
    done = sorted((r for r in records if r.get("status") == "done"), key=lambda r: r["config"]["seed"])
    if not done:
        return None
    first = done[0]["result"]
    extra = {"clients": first.get("clients", []), "domains": first.get("domains", [])}
    if first.get("training_rounds") is not None:
        extra["training_rounds"] = first["training_rounds"]
    return report.summarise_runs([r["result"]["seed_result"] for r in done], algorithm=algorithm,
                                 backbones=list(backbones), rounds=rounds, feature_dims=first.get("feature_dims"),
                                 num_classes=first.get("num_classes"), fraction=fraction, extra=extra)


def _over_seeds(vals: Sequence[float]) -> tuple[float, float] | None:
    vals = [float(v) for v in vals if v is not None and np.isfinite(v)]
    return fm.mean_std(vals) if vals else None


def _units(result: dict[str, Any]) -> tuple[float | None, float | None]:
    """(compute in F, communication in bytes) of one cell by FedNCM App. A."""
    pu = result.get("paper_units") or {}
    if "head_compute_F" in pu:  # fedheads finetune: head stage + fine-tuning stage
        return pu["head_compute_F"] + pu["ft_compute_F"], pu["head_comm_bytes"] + pu["ft_comm_bytes"]
    return pu.get("compute_F"), pu.get("comm_bytes")


def _pooled(seed_result: dict[str, Any]) -> float | None:
    """Accuracy over the union of the clients' test sets: per-client accuracies weighted by test size."""
    pc, nt = seed_result.get("per_client", {}), seed_result.get("n_test") or {}
    w = [(a, nt.get(c, 0)) for c, a in pc.items() if nt.get(c, 0) > 0]
    return sum(a * n for a, n in w) / sum(n for _, n in w) if w else None


def values(agg: dict[str, Any] | None, records: Sequence[dict[str, Any]], metrics: Sequence[str],
           domain_map: dict[str, str]) -> dict[str, tuple[float, float]]:
    """{metric: (mean, std)} for the metrics this arm can report."""
    if agg is None:
        return {}
    done = [r["result"] for r in records if r.get("status") == "done"]
    out: dict[str, tuple[float, float]] = {}
    for m in metrics:
        v: tuple[float, float] | None = None
        if m in ("acc", "r1"):
            v = (agg["accuracy"]["mean"], agg["accuracy"]["std"])
        elif m.startswith("domain:"):
            dom = domain_map.get(m.split(":", 1)[1])
            clients = [c for c, d in zip(agg.get("clients", []), agg.get("domains", [])) if d == dom]
            if dom is not None and clients:
                v = _over_seeds([np.mean([r["seed_result"]["per_client"][c] for c in clients
                                          if c in r["seed_result"]["per_client"]] or [np.nan]) for r in done])
        elif m in fm.FAIRNESS_KEYS:
            v = (agg["fairness"][m], agg["fairness_std"][m])
        elif m == "comm_params":
            n = agg["communication"].get("paper_comm_params_per_client_per_round")
            v = None if n is None else (float(n), 0.0)
        elif m == "train_params":
            n = agg.get("paper_trainable_params_per_client") or agg.get("trainable_params_per_client")
            v = None if n is None else (float(n), 0.0)
        elif m in ("compute_F", "comm_GB"):
            i = 0 if m == "compute_F" else 1
            scale = 1.0 if m == "compute_F" else 1e-9
            v = _over_seeds([(u * scale if u is not None else None) for u in (_units(r)[i] for r in done)])
        elif m in ("r5", "wst_r5"):  # `fedheads feddra` results.json: retrieval.t2i_r5.{mean,worst}.mean (%)
            key = "mean" if m == "r5" else "worst"
            v = _over_seeds([((r.get("retrieval") or {}).get("t2i_r5", {}).get(key) or {}).get("mean")
                             for r in done])
        elif m == "up_values":  # measured: the values one client's message holds (fine-tuning stage)
            n = (agg.get("communication") or {}).get("upload_params_per_client_per_round")
            v = None if n is None else (float(n), 0.0)
        elif m == "round_s":  # fine-tuning cells: wall seconds of a training round (client updates + aggregation)
            v = _over_seeds([((r.get("stages") or [{}])[-1] or {}).get("seconds_per_round") for r in done])
        elif m == "acc_pooled":  # every client's test samples as one test set (a global test set for a global head)
            v = _over_seeds([_pooled(r["seed_result"]) for r in done])
        elif m in ("wst_r1", "disparity"):
            per = [list(r["seed_result"]["per_client"].values()) for r in done]
            f = (lambda a: min(a)) if m == "wst_r1" else (lambda a: max(a) - min(a))
            v = _over_seeds([f(a) for a in per if a])
        if v is not None:
            out[m] = v
    return out


def curves(records: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Accuracy against rounds, cumulative communication (bytes) and computation (F), mean over seeds:
    fine-tuning cells carry FedNCM Figure 1's curve; head cells get one from their history and the
    App. A per-round units (LP), or a single point (FedNCM)."""
    done = [r["result"] for r in records if r.get("status") == "done"]
    by_round: dict[int, list[tuple[float, float, float]]] = {}
    for res in done:
        if res.get("figure1"):
            pts = [(p["round"], p["accuracy"], p["paper_comm_bytes"], p["paper_compute_F"]) for p in res["figure1"]]
        else:
            pu = res.get("paper_units") or {}
            per = pu.get("per_round")
            hist = res["seed_result"].get("history", [])
            if per:
                pts = [(h["round"], h["accuracy"], per["comm_bytes"] * h["round"], per["compute_F"] * h["round"])
                       for h in hist]
            elif pu:
                pts = [(h["round"], h["accuracy"], pu["comm_bytes"], pu["compute_F"]) for h in hist[-1:]]
            else:
                pts = [(h["round"], h["accuracy"], np.nan, np.nan) for h in hist]
        for rnd, acc, cb, cf in pts:
            by_round.setdefault(int(rnd), []).append((acc, cb, cf))
    out = []
    for rnd in sorted(by_round):
        a = np.array(by_round[rnd], dtype=float)
        out.append({"round": rnd, "accuracy": float(a[:, 0].mean()),
                    "std": float(a[:, 0].std(ddof=1)) if len(a) > 1 else 0.0,
                    "comm_bytes": float(a[:, 1].mean()), "compute_F": float(a[:, 2].mean())})
    return out


def fmt(metric: str, v: tuple[float, float] | None, decimals: int = 2) -> str:
    if v is None:
        return "-"
    if metric in COUNTS:
        return f"{int(round(v[0])):,}"
    if metric in SCIENTIFIC:
        return f"{v[0]:.2e}" if v[1] == 0 or v[1] is None else f"{v[0]:.2e} ({v[1]:.1e})"
    return fm.format_mean_std(v[0], v[1] or 0.0, decimals)
