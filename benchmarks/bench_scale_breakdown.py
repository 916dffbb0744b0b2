"""Where the peak memory of `fedheads train` goes, stage by stage, on bench_scale.py's federation
(Pareto client sizes, mean 1,000 rows, 512-d): the resident size (RSS) above the baseline at the
start of each stage and its peak during it, as multiples of the feature bytes (the scale target:
at most 1.5x). Stages: the store's load, each algorithm's `init`, every round's client updates
(each algorithm `client_update` call inside), server aggregation, evaluation and checkpoint.
RSS is sampled every 10 ms by a thread of the measured subprocess (a diagnosis, not the peak
figure: bench_scale.py reads the kernel's VmHWM for that; the two agree within a sample).

Usage: python benchmarks/bench_scale_breakdown.py [--clients 1000] [--algorithm fedpcl]
           [--layout bucketed] [--rounds 2] [--work DIR] [--out FILE]
The store is written to --work (kept: a re-run reuses it). Writes --out (default
benchmarks/results/scale_breakdown.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_memory import CHILD_PRELUDE, write_store  # sibling modules: the same measured process and store
from bench_scale import pareto_sizes
from machine_info import child_env, machine, write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CHILD = CHILD_PRELUDE + r'''
import threading, time
import fedheads.core.engine as E, fedheads.run.train as R, fedheads.run.checkpoint as RS
from fedheads.algorithms import create_algorithm
stage, peaks, order, n = ["start"], {}, [], [0]

def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

def sampler():
    while True:
        r, s = rss(), stage[0]
        if s not in peaks:
            peaks[s] = [r, r]
            order.append(s)
        peaks[s][1] = max(peaks[s][1], r)
        time.sleep(0.01)

def staged(fn, label, nested=False):
    def g(*x, **k):
        prev = stage[0]
        n[0] += 1
        stage[0] = f"{prev} > {label}" if nested else f"{n[0]:03d} {label}"
        try:
            return fn(*x, **k)
        finally:
            n[0] += 1
            stage[0] = prev if nested else f"{n[0]:03d} after {label}"
    return g

threading.Thread(target=sampler, daemon=True).start()
R.load_fed_data = staged(R.load_fed_data, "load")
E.client_updates = staged(E.client_updates, "client updates")
E.evaluate = staged(E.evaluate, "evaluate")
RS.HeadCheckpoint.save = staged(RS.HeadCheckpoint.save, "checkpoint")
cls = type(create_algorithm(a["algorithm"]))
for meth in ("init", "client_update", "server_aggregate"):
    setattr(cls, meth, staged(getattr(cls, meth), meth, nested=True))
fedheads.cli.main(["train", "--store", a["store"], "--backbones", "synthetic", "--algorithm", a["algorithm"],
                   "--layout", a["layout"], "--rounds", str(a["rounds"]), "--seeds", "0", "--device", "cpu",
                   "--eval-every", "1", "--quiet", "--out", a["out"]], standalone_mode=False)
stage[0] = "end"
time.sleep(0.05)
print("RESULT " + json.dumps({"baseline_rss": base, "hwm": status()[1], "stages": [[s] + peaks[s] for s in order]}))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--algorithm", default="fedpcl")
    ap.add_argument("--layout", default="bucketed")
    ap.add_argument("--rounds", type=int, default=2, help="FedPCL's round 0 only uploads prototypes: 2 = one training round")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--work", default=None, help="where the store is written (and reused)")
    ap.add_argument("--out", default=str(HERE / "results" / "scale_breakdown.json"))
    a = ap.parse_args()
    from embedcache.errors import UserError
    from fedheads.algorithms import create_algorithm

    try:  # a bad name stops here, before minutes of writing the store
        create_algorithm(a.algorithm)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    if a.layout not in ("padded", "bucketed", "auto") or a.clients < 1 or a.rounds < 1:
        raise SystemExit(f"error: --layout padded|bucketed|auto, --clients and --rounds >= 1 (got {a.layout}, "
                         f"{a.clients}, {a.rounds})")
    work = Path(a.work or tempfile.mkdtemp(prefix="scale_breakdown_"))
    store, fed_file = work / f"s{a.clients}.zarr", work / f"s{a.clients}.json"
    if not fed_file.is_file():
        fed_file.write_text(json.dumps(write_store(store, pareto_sizes(a.clients, 1000), 512, 10, seed=0)))
    fed = json.loads(fed_file.read_text())
    args = json.dumps({"store": str(store), "out": str(work / "run"), "algorithm": a.algorithm, "layout": a.layout,
                       "rounds": a.rounds, "threads": a.threads})
    env = child_env()
    subprocess.run(["rm", "-rf", str(work / "run")], check=True)
    p = subprocess.run([sys.executable, "-c", CHILD, args], env=env, capture_output=True, text=True, timeout=6 * 3600)
    if p.returncode != 0:
        raise SystemExit(f"subprocess failed:\n{p.stderr[-3000:]}")
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    fb, base = fed["feature_bytes"], r["baseline_rss"]
    stages = [{"stage": s, "start": round((first - base) / fb, 3), "peak": round((peak - base) / fb, 3)}
              for s, first, peak in r["stages"]]
    out = {"benchmark": "scale_breakdown", "clients": a.clients, "algorithm": a.algorithm, "layout": a.layout,
           "rounds": a.rounds, "federation": fed, "machine": machine("cpu"), "threads": a.threads,
           "peak_multiple_of_feature_bytes": round((r["hwm"] - base) / fb, 3), "stages": stages,
           "how": __doc__.split("\n\n")[0]}
    write_json(out, a.out)
    print(f"peak {out['peak_multiple_of_feature_bytes']}x the feature bytes ({fb / 1e9:.2f} GB)")
    for st in stages:
        print(f"{st['start']:6.3f} {st['peak']:6.3f}  {st['stage']}")


if __name__ == "__main__":
    main()
