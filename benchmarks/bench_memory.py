"""Peak memory of `fedheads train` at scale, as a multiple of the feature bytes.

Builds a federation of 200 clients with log-normal sizes (the quantiles of sigma 0.6: mean about
1,000 rows, the largest 4,492; 80 % train / 20 % test), 512-d float32 features, as a real Zarr feature store
(embedcache.store's writer) in a temporary directory. Then, each in a fresh subprocess:
  * `load`   : fedheads.run.load.load_fed_data alone (the padded tensors are the floor);
  * `fedncm` : `fedheads train --algorithm fedncm --rounds 1`;
  * `lp`     : `fedheads train --algorithm lp --rounds 2`.
The subprocess first imports everything the command imports (torch, zarr, fedheads, matplotlib),
records its RSS as the baseline and resets the kernel's peak-RSS counter (/proc/self/clear_refs),
runs the command in-process and reads VmHWM: peak above baseline / feature bytes is reported.
`padded_multiple` is what dense [M, Nmax, D] train + test tensors take by themselves (the padded
layout, what `load` reads); `fedncm` and `lp` run `fedheads train`'s default layout (`auto`, which
holds this skewed federation in size buckets, fedheads/core/federation.py; bench_scale.py compares the two
layouts). Everything above the layout's own tensors is copies. `--baseline-rev REV` measures the code of a
git revision the same way (extracted with `git archive`), for a before/after comparison.

Usage: python benchmarks/bench_memory.py [--baseline-rev REV] [--quick]
Writes benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import NormalDist

import numpy as np
from machine_info import machine, write_json  # sibling module (benchmarks/ is on sys.path)

from embedcache.store import writer as S

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# the measured subprocess's start (shared with bench_scale.py): argv[1] = JSON arguments `a`
# (with "threads"); imports everything a run needs, then `base` = RSS and the peak-RSS counter reset
CHILD_PRELUDE = r"""
import json, sys
a = json.loads(sys.argv[1])
import numpy, torch, zarr
import embedcache.store.reader, fedheads.cli, fedheads.run.train, fedheads.report.results, fedheads.run.load
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot
torch.set_num_threads(a["threads"])

def status():
    f = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(("VmRSS", "VmHWM"))}
    return f["VmRSS"], f["VmHWM"]

base, hwm0 = status()
try:
    open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
    reset = True
except OSError:
    reset = False
"""

# runs inside the measured subprocess: argv[1] = JSON {"mode", "store", "out", "threads"}
CHILD = CHILD_PRELUDE + r"""
if a["mode"] == "load":
    d = fedheads.run.load.load_fed_data(a["store"], ["synthetic"], device="cpu")
    del d
else:
    rounds = "1" if a["mode"] == "fedncm" else "2"
    fedheads.cli.main(["train", "--store", a["store"], "--backbones", "synthetic", "--algorithm", a["mode"],
                       "--rounds", rounds, "--seeds", "0", "--device", "cpu", "--quiet", "--out", a["out"]],
                      standalone_mode=False)
rss, hwm = status()
print("RESULT " + json.dumps({"baseline_rss": base, "peak_rss": hwm, "peak_reset": reset,
                              "peak_before_reset": hwm0}))
"""


def sizes(clients: int, largest: int = 4492, sigma: float = 0.6) -> np.ndarray:
    """Log-normal client sizes, deterministic (the distribution's quantiles (i + 0.5) / M),
    rescaled so the largest has `largest` rows; sigma 0.6 makes the mean about 1,000."""
    q = np.array([NormalDist().inv_cdf((i + 0.5) / clients) for i in range(clients)])
    raw = np.exp(sigma * q)
    return np.maximum(5, np.round(raw * largest / raw.max())).astype(int)


def write_store(path: Path, n_rows: np.ndarray, dim: int, classes: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    names = [f"class{c}" for c in range(classes)]
    clients = [f"c{k:03d}" for k in range(len(n_rows))]
    S.init_store(path, names, "bench-memory", clients=clients)
    centers = rng.normal(size=(classes, dim)).astype(np.float32)
    n_tr = [int(round(0.8 * n)) for n in n_rows]
    for k, (c, n) in enumerate(zip(clients, n_rows)):
        for split, m in (("train", n_tr[k]), ("test", int(n) - n_tr[k])):
            y = rng.integers(0, classes, size=m)
            x = centers[y] + rng.normal(size=(m, dim)).astype(np.float32)
            spec = S.ShardSpec(backbone="synthetic", weights_sha256="0" * 64, preprocess={}, feature_dim=dim,
                               client=c, split=split, domain="synthetic", manifest_hash="bench-memory",
                               sample_list_hash=f"{c}-{split}", sample_ids=tuple(f"{c}/{split}/{i}" for i in range(m)),
                               labels=tuple(int(v) for v in y))
            S.write_shard(path, spec, x)
    S.consolidate(path)
    n_te = [int(n) - t for n, t in zip(n_rows, n_tr)]
    M, fb = len(clients), 4 * dim
    return {"clients": M, "dim": dim, "classes": classes, "rows_total": int(n_rows.sum()),
            "rows_mean": float(n_rows.mean()), "rows_max": int(n_rows.max()),
            "train_rows_max": max(n_tr), "test_rows_max": max(n_te),
            "feature_bytes": int(n_rows.sum()) * fb,
            "padded_bytes": M * (max(n_tr) + max(n_te)) * fb}


def measure(mode: str, store: Path, out: Path, pythonpath: str, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pythonpath, str(HERE)])}
    args = json.dumps({"mode": mode, "store": str(store), "out": str(out), "threads": threads})
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHILD, args], env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{mode}: subprocess failed:\n{p.stderr[-3000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    r["seconds"] = round(time.perf_counter() - t, 2)
    return r


def code_tree(rev: str, dest: Path) -> str:
    """The fedheads + embedcache packages of git revision `rev`, extracted under `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, "fedheads", "embedcache"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    return str(dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline-rev", default="", help="also measure this git revision's code (before/after)")
    ap.add_argument("--quick", action="store_true", help="20 clients (smoke test, not a figure)")
    ap.add_argument("--out", default=str(HERE / "results" / "memory.json"))
    a = ap.parse_args()
    clients = 20 if a.quick else a.clients
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store.zarr"
        t0 = time.perf_counter()
        fed = write_store(store, sizes(clients), a.dim, a.classes, seed=0)
        fed["store_write_seconds"] = round(time.perf_counter() - t0, 1)
        fed["padded_multiple"] = round(fed["padded_bytes"] / fed["feature_bytes"], 3)
        trees = {"current": str(REPO)}
        if a.baseline_rev:
            trees[f"baseline@{a.baseline_rev}"] = code_tree(a.baseline_rev, Path(tmp) / "baseline")
        runs: dict = {}
        for label, tree in trees.items():
            runs[label] = {}
            for mode in ("load", "fedncm", "lp"):
                r = measure(mode, store, Path(tmp) / f"run-{label}-{mode}", tree, a.threads)
                r["peak_above_baseline_bytes"] = r["peak_rss"] - r["baseline_rss"]
                r["multiple_of_feature_bytes"] = round(r["peak_above_baseline_bytes"] / fed["feature_bytes"], 3)
                runs[label][mode] = r
                print(f"{label:>20s} {mode:7s} peak above baseline {r['peak_above_baseline_bytes'] / 2**20:8.0f} MiB"
                      f" = {r['multiple_of_feature_bytes']:.2f}x features (padded floor {fed['padded_multiple']:.2f}x)",
                      flush=True)
    result = {"federation": fed, "runs": runs, "machine": machine("cpu"), "method": __doc__.split("\n\n")[1]}
    write_json(result, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
