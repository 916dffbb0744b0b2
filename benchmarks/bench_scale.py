"""Peak memory and seconds per round of `fedheads train` on a skewed federation: the padded layout
(every client padded to the largest: "before") against size buckets ("after", fedheads/core/federation.py).

Federation: M in {100, 300, 1000} clients whose sizes follow a Pareto law with
shape alpha = 2 (a power law: P(N > n) ~ n^-2), taken at the quantiles (i + 0.5) / M so the
sizes are deterministic, rescaled to a mean of 1,000 rows (at least 10), in a seeded random
client order; 80 % train / 20 % test per client; 512-d float32 features of 10 Gaussian class
clusters. 1,000 clients: 1,000,000 rows, 2.05 GB of features, the largest client 22,577 rows.
"Feature bytes" are ALL the features, train and test: 4 * 512 * sum_i N_i.

The store is written with embedcache's store writer in a temporary directory (as
bench_memory.py does) and each case runs `fedheads train --layout L --algorithm A` on it in a
fresh subprocess, the real path from the store: FedNCM 1 round, LP 3 rounds, FedPCL 3 rounds
(round 0 only uploads the initial prototypes). The subprocess imports everything first, records
its RSS as the baseline, resets the kernel's peak-RSS counter (/proc/self/clear_refs) and reads
VmHWM at the end: peak above baseline / feature bytes is the multiple reported. Seconds per
round: the training wall time (client updates + aggregation) of every training round from
results.json's timing, pooled over `--repeats` fresh subprocesses per case (interleaved: padded,
bucketed, padded, ...), as median (min, max); the evaluation time per round beside it. Peak memory:
median (min, max) over the repeats.
A padded case whose padded features alone would exceed `--padded-limit-gb` (default: 40 % of
the memory available at start) is not run, and recorded as skipped with its padded floor.

Usage: python benchmarks/bench_scale.py [--clients 100,300,1000] [--repeats 3] [--quick]
Writes benchmarks/results/scale.json (after every case).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_memory import CHILD_PRELUDE, write_store  # sibling module: the same measured process and store
from machine_info import child_env, machine, write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ROUNDS = {"fedncm": 1, "lp": 3, "fedpcl": 3}
COLLECT = {"fedncm": 0, "lp": 0, "fedpcl": 1}  # rounds that train nothing (FedPCL's round 0)

# runs inside the measured subprocess: argv[1] = JSON {"store", "out", "algorithm", "layout", "rounds", "threads"}
CHILD = CHILD_PRELUDE + r"""
fedheads.cli.main(["train", "--store", a["store"], "--backbones", "synthetic", "--algorithm", a["algorithm"],
                   "--layout", a["layout"], "--rounds", str(a["rounds"]), "--seeds", "0", "--device", "cpu",
                   "--eval-every", "1", "--quiet", "--out", a["out"]], standalone_mode=False)
rss, hwm = status()
print("RESULT " + json.dumps({"baseline_rss": base, "peak_rss": hwm, "peak_reset": reset}))
"""


def pareto_sizes(clients: int, mean: int = 1000, alpha: float = 2.0, seed: int = 0) -> np.ndarray:
    """Pareto(alpha) client sizes at the quantiles (i + 0.5) / M, mean `mean`, seeded order."""
    q = (np.arange(clients) + 0.5) / clients
    raw = (1.0 - q) ** (-1.0 / alpha)
    n = np.maximum(10, np.round(raw * mean / raw.mean())).astype(int)
    return n[np.random.default_rng(seed).permutation(clients)]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def measure(store: Path, out: Path, algorithm: str, layout: str, threads: int) -> dict:
    env = child_env()
    args = json.dumps({"store": str(store), "out": str(out), "algorithm": algorithm, "layout": layout,
                       "rounds": ROUNDS[algorithm], "threads": threads})
    load0 = os.getloadavg()
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, args], env=env, capture_output=True, text=True, timeout=6 * 3600)
    if p.returncode != 0:
        raise SystemExit(f"{algorithm}/{layout}: subprocess failed:\n{p.stderr[-3000:]}")
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    res = json.loads((out / "results.json").read_text())
    timing = res["timing"]
    rounds = timing["per_seed"][0]["rounds"]
    train = rounds["train_wall_seconds"][COLLECT[algorithm]:]
    r.update({"process_seconds": round(time.perf_counter() - t, 2), "load_average_before": list(load0),
              "load_average_after": list(os.getloadavg()), "layout": res["layout"],
              "seconds_per_round": spread(train), "eval_seconds_per_round": spread(rounds["eval_wall_seconds"]),
              "load_seconds": timing["load_wall_seconds"], "accuracy": res["accuracy"]["mean"]})
    return r


def summarise(reps: list[dict], feature_bytes: int) -> dict:
    """A case's figures over its repeats: training / evaluation seconds per round pooled over
    every repeat's rounds; peak memory above the baseline as median (min, max)."""
    peaks = [r["peak_rss"] - r["baseline_rss"] for r in reps]
    mult = spread([round(p / feature_bytes, 3) for p in peaks])
    return {"layout": reps[0]["layout"], "accuracy": reps[0]["accuracy"],
            "seconds_per_round": spread([x for r in reps for x in r["seconds_per_round"]["samples"]]),
            "eval_seconds_per_round": spread([x for r in reps for x in r["eval_seconds_per_round"]["samples"]]),
            "peak_above_baseline_bytes": spread(peaks), "multiple_of_feature_bytes": mult}


def federation(n_rows: np.ndarray, dim: int, classes: int) -> dict:
    from fedheads.core.federation import LayoutConfig, plan_buckets

    n_tr = [int(round(0.8 * n)) for n in n_rows]
    n_te = [int(n) - t for n, t in zip(n_rows, n_tr)]
    plan = plan_buckets(n_tr, n_te, 4 * dim, LayoutConfig("bucketed"))
    held = sum(len(b) * (max(n_tr[i] for i in b) + max(n_te[i] for i in b)) for b in plan)
    return {"buckets": len(plan), "bucketed_floor_multiple": round(held / int(n_rows.sum()), 4),
            "padded_floor_multiple": round(len(n_rows) * (max(n_tr) + max(n_te)) / int(n_rows.sum()), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="100,300,1000")
    ap.add_argument("--algorithms", default="fedncm,lp,fedpcl")
    ap.add_argument("--layouts", default="padded,bucketed")
    ap.add_argument("--mean-rows", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--padded-limit-gb", type=float, default=None,
                    help="skip a padded case whose padded features exceed this (default: 40%% of MemAvailable)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh subprocesses per case (interleaved)")
    ap.add_argument("--quick", action="store_true",
                    help="30 and 60 clients of mean 200 rows, 1 repeat (checks the script, not a figure)")
    ap.add_argument("--out", default=str(HERE / "results" / "scale.json"))
    a = ap.parse_args()
    Ms = [30, 60] if a.quick else [int(m) for m in a.clients.split(",")]
    mean = 200 if a.quick else a.mean_rows
    repeats = 1 if a.quick else max(1, a.repeats)
    limit = a.padded_limit_gb * 1e9 if a.padded_limit_gb else 0.4 * mem_available()
    result: dict = {"method": __doc__.split("\n\n")[1] + "\n\n" + __doc__.split("\n\n")[3],
                    "machine": machine("cpu"), "threads": a.threads, "rounds": ROUNDS, "repeats": repeats, "quick": a.quick,
                    "padded_limit_bytes": int(limit), "federations": {}, "runs": {}}
    for M in Ms:
        n_rows = pareto_sizes(M, mean)
        with tempfile.TemporaryDirectory() as tmp:
            store = Path(tmp) / "store.zarr"
            t0 = time.perf_counter()
            fed = write_store(store, n_rows, a.dim, a.classes, seed=0)
            fed.update(federation(n_rows, a.dim, a.classes), store_write_seconds=round(time.perf_counter() - t0, 1),
                       sizes=f"Pareto alpha=2 at quantiles (i+0.5)/M, mean {mean} rows, 80/20 train/test")
            result["federations"][str(M)] = fed
            print(f"M={M}: {fed['feature_bytes'] / 1e9:.2f} GB features, largest {fed['rows_max']} rows, padded floor "
                  f"{fed['padded_floor_multiple']}x, {fed['buckets']} buckets ({fed['bucketed_floor_multiple']}x)", flush=True)
            runs = result["runs"].setdefault(str(M), {})
            for alg in a.algorithms.split(","):
                for layout in a.layouts.split(","):
                    if layout == "padded" and fed["padded_bytes"] > limit:
                        runs.setdefault(alg, {})[layout] = {
                            "skipped": f"padded features alone {fed['padded_bytes'] / 1e9:.1f} GB > limit {limit / 1e9:.1f} GB"}
                        print(f"  {alg:7s} {layout:9s} skipped (padded features {fed['padded_bytes'] / 1e9:.1f} GB)", flush=True)
                        continue
                    runs.setdefault(alg, {})[layout] = {"repeats": []}
                for k in range(repeats):  # interleaved, so load drifts hit both layouts alike
                    for layout, case in runs[alg].items():
                        if "repeats" in case:
                            case["repeats"].append(measure(store, Path(tmp) / f"run-{alg}-{layout}-{k}", alg, layout,
                                                           a.threads))
                for layout, case in runs[alg].items():
                    if "repeats" not in case:
                        continue
                    r = summarise(case["repeats"], fed["feature_bytes"])
                    case.update(r)
                    print(f"  {alg:7s} {layout:9s} peak {r['multiple_of_feature_bytes']['median']:.2f}x features, "
                          f"{r['seconds_per_round']['median']:.2f} s/round (eval {r['eval_seconds_per_round']['median']:.2f} s), "
                          f"accuracy {r['accuracy']:.1f}", flush=True)
                    write_json(result, a.out)
    write_json(result, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
