"""What the read-time integrity check costs (contract 4: every chunk read is hashed and
compared with the digests recorded at finalisation).

Writes a synthetic store with the real writer (default 10 clients x 20,000 rows x 512-d
float32 = ~410 MB of features, chunk_rows 256), then times, with a warm page cache:
  * unchecked : what load_split did before the check: open_store, then zarr reads of
                features, labels and sample ids for every client, float32 conversion, the
                NaN/inf scan and the concatenation of the backbones' columns;
  * checked   : embedcache.store.reader.load_split of the same shards (the same reads plus the
                per-chunk sha256 of features and of labels + sample ids);
  * open      : embedcache.store.reader.open_store (consolidated metadata and its cheap check
                against the shard directories on disk).
Repeats alternate the two read paths; medians, every repeat, and the ratio are recorded.

Usage: python benchmarks/bench_store_read.py [--clients 10 --rows 20000 --dim 512 --repeats 5]
Writes benchmarks/results/store_read.json (--quick: a small store, result not written).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from machine_info import cpu_model, write_json  # sibling module (benchmarks/ is on sys.path)

from embedcache.store import writer as S
from embedcache.store.reader import load_split, open_store

HERE = Path(__file__).resolve().parent


def write_store(path: Path, clients: int, rows: int, dim: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    S.init_store(path, [f"class{c}" for c in range(10)], "bench-manifest", clients=[f"c{k:02d}" for k in range(clients)])
    for k in range(clients):
        y = rng.integers(0, 10, size=rows)
        x = rng.normal(size=(rows, dim)).astype(np.float32)
        spec = S.ShardSpec(backbone="synthetic", weights_sha256="0" * 64, preprocess={}, feature_dim=dim,
                           client=f"c{k:02d}", split="train", domain="d", manifest_hash="bench-manifest",
                           sample_list_hash=f"h{k}", sample_ids=tuple(f"c{k:02d}/{i:07d}" for i in range(rows)),
                           labels=tuple(int(v) for v in y))
        S.write_shard(path, spec, x)
    S.consolidate(path)


def unchecked_read(path: Path, clients: list[str]) -> int:
    """What load_split did before the integrity check: open_store, then per client the zarr
    reads, float32 conversion, NaN/inf scan and the (one-backbone) concatenation."""
    open_store(path)
    root = zarr.open_group(str(path), mode="r", zarr_format=3)
    total = 0
    for c in clients:
        g = root[f"synthetic/{c}/train"]
        f = np.asarray(g["features"][...], dtype=np.float32)
        y = np.asarray(g["labels"][...], dtype=np.int64)
        ids = np.array(np.asarray(g["sample_ids"][...]).tolist(), dtype=str)
        assert np.isfinite(f).all() and len(y) == len(ids)
        total += np.concatenate([f], axis=1).nbytes
    return total


def checked_read(path: Path, clients: list[str]) -> int:
    return sum(cs.features.nbytes for cs in load_split(path, "synthetic", "train", clients=clients).values())


def timed(fn, *a) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn(*a)
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny store, 2 repeats, no JSON written")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.rows, args.dim, args.repeats = 2, 2000, 64, 2
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.zarr"
        t0 = time.perf_counter()
        write_store(path, args.clients, args.rows, args.dim)
        write_s = time.perf_counter() - t0
        clients = list(open_store(path).clients)
        disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        unchecked_read(path, clients)  # warm the page cache
        runs: dict[str, list[tuple[float, float]]] = {"unchecked": [], "checked": [], "open": []}
        for _ in range(args.repeats):
            runs["unchecked"].append(timed(unchecked_read, path, clients))
            runs["checked"].append(timed(checked_read, path, clients))
            runs["open"].append(timed(open_store, path))
    med = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    out = {
        "benchmark": "read-time integrity check (per-chunk sha256) vs the same reads unchecked",
        "clients": args.clients, "rows_per_client": args.rows, "dim": args.dim, "chunk_rows": S.DEFAULT_CHUNK_ROWS,
        "feature_bytes": args.clients * args.rows * args.dim * 4, "store_bytes_on_disk": disk,
        "store_write_seconds": round(write_s, 3), "repeats": args.repeats,
        **{f"{k}_wall_seconds_median": round(v, 4) for k, v in med.items()},
        **{f"{k}_cpu_seconds_median": round(statistics.median(c for _, c in v), 4) for k, v in runs.items()},
        **{f"{k}_wall_seconds_all": [round(w, 4) for w, _ in v] for k, v in runs.items()},
        "ratio_checked_over_unchecked": round(med["checked"] / med["unchecked"], 3),
        "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "python": sys.version.split()[0],
                    "numpy": np.__version__, "zarr": zarr.__version__, "platform": platform.platform(),
                    "loadavg_1m": os.getloadavg()[0]},
    }
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_all")}, indent=2))
    if not args.quick:
        write_json(out, HERE / "results" / "store_read.json")


if __name__ == "__main__":
    main()
