"""`embedcache import` of a cross-device federation: clients per second at N clients ->
benchmarks/results/import.json.

    python benchmarks/bench_import.py [--clients 1000,10000] [--repeats 1] [--quick]

For each N: a directory of per-client files (`c00000_train.npz` with 4 rows, `c00000_test.npz`
with 2 rows, 8-d float32, labels of 3 classes), written once, then `embedcache import DIR --store
S --backbone f8` as a fresh process into an empty store, `--repeats` times. Reported per N: median
wall seconds and min/max, clients per second, peak RSS of the import, and the store's files and
bytes on disk per client. A store's time per client that grows with N is a cost that is not linear
in the federation (a scan of every client per shard); the figures at two sizes show it.
--quick: 50 and 200 clients, result not written.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from machine_info import cpu_model, write_json

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def write_source(d: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    d.mkdir(parents=True)
    for c in range(n):
        for split, rows in (("train", 4), ("test", 2)):
            np.savez(d / f"c{c:05d}_{split}.npz", features=rng.normal(size=(rows, 8)).astype(np.float32),
                     labels=np.arange(rows) % 3)


def disk(store: Path) -> tuple[int, int]:
    files = size = 0
    for root, _, names in os.walk(store):
        for name in names:
            files += 1
            size += os.path.getsize(os.path.join(root, name))
    return files, size


def one(src: Path, store: Path) -> tuple[float, int]:
    t = time.perf_counter()
    r = subprocess.run([str(BIN / "embedcache"), "import", str(src), "--store", str(store), "--backbone", "f8"],
                       capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"import of {src}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1000,10000")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    sizes = [50, 200] if a.quick else [int(x) for x in a.clients.split(",")]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            src = Path(tmp) / f"src{n}"
            write_source(src, n)
            walls, peaks = [], []
            load0 = os.getloadavg()
            for i in range(a.repeats):
                store = Path(tmp) / f"store{n}-{i}.zarr"
                wall, peak = one(src, store)
                walls.append(wall)
                peaks.append(peak)
                files, size = disk(store)
                print(f"{n} clients: {wall:.1f} s, {n / wall:.1f} clients/s", flush=True)
            med = statistics.median(walls)
            rows[str(n)] = {"clients": n, "shards": 2 * n, "median_s": round(med, 2), "min_s": round(min(walls), 2),
                            "max_s": round(max(walls), 2), "clients_per_second": round(n / med, 2),
                            "ms_per_shard": round(1000 * med / (2 * n), 2), "peak_rss_bytes_max": max(peaks),
                            "files_per_client": round(files / n, 1), "bytes_per_client": round(size / n),
                            "load_average_before": [round(x, 2) for x in load0],
                            "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    res = {"method": "one fresh `embedcache import` process per repeat into an empty store; source: a directory of "
                     "per-client .npz files (4 train + 2 test rows, 8-d)",
           "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "python": sys.version.split()[0]},
           "repeats": a.repeats, "sizes": rows}
    if not a.quick:
        write_json(res, HERE / "results" / "import.json")


if __name__ == "__main__":
    main()
