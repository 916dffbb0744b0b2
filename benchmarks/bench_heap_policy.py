"""`fedheads train` on padded data with and without its heap policy (fedheads.run.allocator.GlibcHeap.training:
freed blocks kept for reuse while the rounds run, fedheads/run/allocator.py).

Federation: 80 clients x 120 rows of 1536-d float32 features (the size of FedPCL's 3-backbone
experiments), 10 classes, written with embedcache's store writer; FedAvg (a [80, 1536, hidden]
weight stack copied, trained and averaged every round), 40 rounds, no evaluation between rounds.
Each run is a fresh subprocess of the real command, policy on and off interleaved (on, off, off,
on, ...), `--repeats` each. Recorded per run: training CPU and wall seconds (results.json timing),
the process's peak RSS (ru_maxrss). Writes benchmarks/results/heap_policy.json.

    python benchmarks/bench_heap_policy.py [--repeats 3] [--rounds 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from bench_memory import write_store  # sibling modules
from machine_info import machine, write_json

HERE = Path(__file__).resolve().parent
CHILD = r'''
import contextlib, json, resource, sys
import fedheads.cli, fedheads.run.allocator as H
mode, store, out, rounds = sys.argv[1:5]
if mode == "off":
    H.GlibcHeap.training = lambda self, padded: contextlib.nullcontext()
fedheads.cli.main(["train", "--store", store, "--backbones", "synthetic", "--algorithm", "fedavg", "--layout", "padded",
                   "--rounds", rounds, "--seeds", "0", "--device", "cpu", "--eval-every", "0", "--quiet", "--out", out,
                   "--overwrite"], standalone_mode=False)
t = json.load(open(out + "/results.json"))["timing"]["per_seed"][0]
print("RESULT " + json.dumps({"train_cpu_seconds": t["train_cpu_seconds"], "train_wall_seconds": t["train_wall_seconds"],
                              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--out", default=str(HERE / "results" / "heap_policy.json"))
    a = ap.parse_args()
    if a.repeats < 1 or a.rounds < 1:
        raise SystemExit(f"error: --repeats and --rounds must be >= 1 (got {a.repeats}, {a.rounds})")
    work = Path(tempfile.mkdtemp(prefix="heap_policy_"))
    try:
        runs, fed = _measure(work, a.repeats, a.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _report(runs, fed, a)


def _measure(work: Path, repeats: int, rounds: int) -> tuple[dict[str, list[dict]], dict]:
    fed = write_store(work / "s.zarr", np.full(80, 120), 1536, 10, seed=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's defaults in both modes
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE)])
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for rep in range(repeats):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            p = subprocess.run([sys.executable, "-c", CHILD, mode, str(work / "s.zarr"), str(work / f"run_{mode}"),
                                str(rounds)], env=env, capture_output=True, text=True, timeout=3600)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                raise SystemExit(f"error: the {mode} run failed: {p.stderr.strip().splitlines()[-1:]}")
            runs[mode].append(json.loads(line[len("RESULT "):]))
    return runs, fed


def _report(runs: dict[str, list[dict]], fed: dict, a: argparse.Namespace) -> None:
    def stats(mode: str, key: str) -> dict:
        xs = [r[key] for r in runs[mode]]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}

    summary = {m: {k: stats(m, k) for k in runs[m][0]} for m in runs}
    out = {"benchmark": "heap_policy", "how": __doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
           "federation": {"clients": 80, "rows": 120, "dim": 1536, "classes": 10, "feature_bytes": fed["feature_bytes"]},
           "algorithm": "fedavg", "rounds": a.rounds, "repeats": a.repeats, "machine": machine("cpu"), "runs": summary,
           "cpu_ratio_off_over_on": summary["off"]["train_cpu_seconds"]["median"] / summary["on"]["train_cpu_seconds"]["median"],
           "peak_ratio_on_over_off": summary["on"]["peak_rss_bytes"]["median"] / summary["off"]["peak_rss_bytes"]["median"]}
    write_json(out, a.out)
    for m in ("on", "off"):
        s = summary[m]
        print(f"policy {m:3s}: train CPU {s['train_cpu_seconds']['median']:.1f} s, "
              f"wall {s['train_wall_seconds']['median']:.1f} s, peak RSS {s['peak_rss_bytes']['median'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
