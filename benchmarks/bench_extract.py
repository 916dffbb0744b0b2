"""Extraction throughput on Office-Caltech-10 -> benchmarks/results/extract.json.

    EMBEDCACHE_ASSETS=../shared python benchmarks/bench_extract.py [--per-domain 100] [--backbones ...]

For each backbone it measures, on the same fixed subset (the first `--per-domain` images of
each domain in sorted path order, split train/test 2:1 per client):
- decode+preprocess alone (the extractor's thread pool, no model),
- forward alone on the already preprocessed tensors (same batch size),
- the full cold `extract` into a fresh store (decode, forward and writes overlapped),
  and ratio = full / (1 / (1/decode + 1/forward)), i.e. against running the two back to back;
- a cache-hit re-run (same process, backbone modules already imported) vs the cold run;
- `--scheduler local:2` (cold, includes starting the cluster) vs the single process, and
  whether its store is bitwise identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from machine_info import cpu_model  # sibling module (benchmarks/ is on sys.path)

from embedcache.backbones import create_backbone
from embedcache.extract import ExtractConfig, batch_bounds, decode_sample, extract, forward
from embedcache.manifest import Client, Manifest, Sample
from embedcache.reader import load_split
from embedcache.sources import open_source

REPO = Path(__file__).resolve().parents[1]


def subset_manifest(root: Path, per_domain: int) -> Manifest:
    """One client per domain over its first `per_domain` images (0: all); every third to test."""
    domains = sorted(p.name for p in root.iterdir() if p.is_dir())
    classes = tuple(sorted(p.name for p in (root / domains[0]).iterdir() if p.is_dir()))
    clients = []
    for d in domains:
        files = sorted((root / d).glob("*/*.jpg"))
        files = files[:per_domain] if per_domain else files
        rows = [Sample(str(f.relative_to(root)), str(f.relative_to(root)), classes.index(f.parent.name)) for f in files]
        clients.append(Client(f"c-{d}", d, tuple(r for i, r in enumerate(rows) if i % 3),
                              tuple(r for i, r in enumerate(rows) if i % 3 == 0)))
    return Manifest(f"imagefolder:{root}", classes, tuple(clients), recipe={"bench": "extract", "per_domain": per_domain})


def bench_backbone(name: str, m: Manifest, src: Any, args, tmp: Path) -> dict:
    bb = create_backbone(name, device="cpu")
    rows = [(s.id, s.locator) for c in m.clients for split in ("train", "test") for s in m.samples(c.name, split)]
    n = len(rows)
    # Warm-up outside the clock: lazy imports (torchvision transforms) and first-call kernels.
    warm = [decode_sample(bb, src, r[0], r[1], 1)[0] for r in rows[:2]]
    forward(bb, warm, bb.feature_dim)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.num_workers) as pool:
        items = list(pool.map(lambda r: decode_sample(bb, src, r[0], r[1], 1), rows))
    t_dec = time.perf_counter() - t0
    tensors = [it[0] for it in items]
    t0 = time.perf_counter()
    for a, b in batch_bounds(n, args.batch_size):
        forward(bb, tensors[a:b], bb.feature_dim)
    t_fwd = time.perf_counter() - t0
    del items, tensors
    cfg = ExtractConfig(backbones=(name,), store=str(tmp / f"{name}-single"), batch_size=args.batch_size,
                        num_workers=args.num_workers, progress=False)
    t0 = time.perf_counter()
    extract(m, cfg, source=src)
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = extract(m, cfg, source=src)
    t_hit = time.perf_counter() - t0
    assert rep.rows_computed == 0
    dcfg = ExtractConfig(backbones=(name,), store=str(tmp / f"{name}-dask"), batch_size=args.batch_size,
                         num_workers=1, scheduler="local:2", progress=False)
    t0 = time.perf_counter()
    extract(m, dcfg, source=src)
    t_dask = time.perf_counter() - t0
    same = all(
        load_split(cfg.store, name, sp)[c].features.tobytes() == load_split(dcfg.store, name, sp)[c].features.tobytes()
        for sp in ("train", "test") for c in (cl.name for cl in m.clients))
    dec, fwd, full = n / t_dec, n / t_fwd, n / t_full
    ideal = 1.0 / (1.0 / dec + 1.0 / fwd)
    return {
        "backbone": name, "feature_dim": bb.feature_dim, "input_size": bb.preprocess.get("input_size"),
        "images": n, "decode_img_s": round(dec, 1), "forward_img_s": round(fwd, 1), "full_extract_img_s": round(full, 1),
        "sequential_bound_img_s": round(ideal, 1), "full_over_sequential": round(full / ideal, 3),
        "cold_extract_s": round(t_full, 3), "cache_hit_s": round(t_hit, 4), "cold_over_cache_hit": round(t_full / t_hit, 1),
        "dask_local2_s": round(t_dask, 3), "single_over_dask_local2": round(t_full / t_dask, 3),
        "dask_bitwise_identical": same,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="Office-Caltech-10 root (default: $EMBEDCACHE_ASSETS/data/office_caltech10)")
    p.add_argument("--per-domain", type=int, default=100, help="first N images per domain (0 = all 2,533)")
    p.add_argument("--backbones", default="resnet20-cifar10,mobilenet-v2-tflite")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "extract.json"))
    args = p.parse_args()
    assets = Path(os.environ.get("EMBEDCACHE_ASSETS", REPO.parent / "shared"))
    root = Path(args.data) if args.data else assets / "data" / "office_caltech10"
    if not root.is_dir():
        raise SystemExit(f"{root}: Office-Caltech-10 not found (set EMBEDCACHE_ASSETS or --data)")
    m = subset_manifest(root, args.per_domain)
    src = open_source(m.source)
    tmp = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    results = []
    try:
        for name in args.backbones.split(","):
            r = bench_backbone(name, m, src, args, tmp)
            print(json.dumps(r))
            results.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "benchmark": "extract", "data": str(root.name),
        "subset": f"first {args.per_domain} images per domain (sorted paths), 4 domains" if args.per_domain else "all",
        "batch_size": args.batch_size, "num_workers": args.num_workers,
        "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "torch": torch.__version__, "device": "cpu",
        "torch_threads": torch.get_num_threads(), "results": results,
        "note": "shared machine: other jobs were running; dask time includes starting the LocalCluster",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp_out = Path(args.out).with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp_out, args.out)


if __name__ == "__main__":
    main()
