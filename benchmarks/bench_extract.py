"""Extraction throughput on Office-Caltech-10 (or any image source) -> benchmarks/results/extract.json.

    EMBEDCACHE_ASSETS=../shared python benchmarks/bench_extract.py [--per-domain 100] [--backbones ...]
        [--source SPEC] [--device cpu|cuda] [--weights-dir DIR] [--no-dask] [--compare-cpu]

Data and weights are found as the CLIs find them (benchmarks/assets.py): by default
imagefolder:<assets>/data/office_caltech10, <assets> = $EMBEDCACHE_ASSETS or ../shared.

For each backbone it measures, on the same fixed subset (the first `--per-domain` images of
each domain in sorted locator order, split train/test 2:1 per client):
- decode+preprocess alone (the extractor's thread pool, no model),
- forward alone on the already preprocessed tensors (same batch size),
- the full cold `extract` into a fresh store (decode, forward and writes overlapped),
  and ratio = full / (1 / (1/decode + 1/forward)), i.e. against running the two back to back;
- a cache-hit re-run (same process, backbone modules already imported) vs the cold run;
- `--scheduler local:2` (cold, includes starting the cluster) vs the single process, and
  whether its store is bitwise identical (left out with --no-dask);
- with --compare-cpu on CUDA: the forward pass on the CPU over the first batches, and the
  largest difference of the CUDA features from the CPU ones (CUDA runs under autocast).
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

import assets  # sibling modules (benchmarks/ is on sys.path)
import torch
from machine_info import cpu_model, write_json

from embedcache.backbones import create_backbone
from embedcache.chunks import batch_bounds, decode_sample, forward
from embedcache.extraction import ExtractConfig, extract
from embedcache.manifest import Client, Manifest, Sample
from embedcache.sources import open_source
from embedcache.store.reader import load_split

REPO = Path(__file__).resolve().parents[1]


def subset_manifest(src: Any, per_domain: int) -> Manifest:
    """One client per domain over its first `per_domain` images in locator order (0: all);
    every third image to test."""
    rows_by_domain: dict[str, list[tuple[str, int]]] = {}
    for domain, locator, label in src.index():
        rows_by_domain.setdefault(domain, []).append((locator, label))
    clients = []
    for d in sorted(rows_by_domain):
        picked = sorted(rows_by_domain[d])
        picked = picked[:per_domain] if per_domain else picked
        rows = [Sample(loc, loc, label) for loc, label in picked]
        clients.append(Client(f"c-{d}", d, tuple(r for i, r in enumerate(rows) if i % 3),
                              tuple(r for i, r in enumerate(rows) if i % 3 == 0)))
    return Manifest(src.spec, tuple(src.classes()), tuple(clients), recipe={"bench": "extract", "per_domain": per_domain})


def cpu_comparison(name: str, weights_dir: str, tensors: list, batch_size: int, cuda_feats: Any) -> dict:
    """CPU forward throughput on the same tensors and the largest |CUDA - CPU| feature gap."""
    import numpy as np

    cpu = create_backbone(name, weights_dir=weights_dir, device="cpu")
    forward(cpu, tensors[:2], cpu.feature_dim)  # warm-up
    t0 = time.perf_counter()
    ref = np.concatenate([forward(cpu, tensors[a:b], cpu.feature_dim) for a, b in batch_bounds(len(tensors), batch_size)])
    secs = time.perf_counter() - t0
    scale = float(np.abs(ref).max()) or 1.0
    return {"cpu_forward_img_s": round(len(tensors) / secs, 1), "cpu_rows_compared": len(tensors),
            "max_abs_diff_cuda_vs_cpu": float(np.abs(cuda_feats - ref).max()),
            "max_abs_diff_over_max_abs": float(np.abs(cuda_feats - ref).max()) / scale}


def bench_backbone(name: str, m: Manifest, src: Any, args, tmp: Path) -> dict:
    bb = create_backbone(name, weights_dir=args.weights_dir, device=args.device)
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
    first = []  # features of the first rows, for the CPU comparison
    for a, b in batch_bounds(n, args.batch_size):
        f = forward(bb, tensors[a:b], bb.feature_dim)  # returns on the CPU: CUDA work is finished
        if a < args.compare_rows:
            first.append(f)
    t_fwd = time.perf_counter() - t0
    extra: dict = {}
    if args.compare_cpu and args.device != "cpu":
        import numpy as np

        k = min(n, args.compare_rows)
        extra = cpu_comparison(name, args.weights_dir, tensors[:k], args.batch_size, np.concatenate(first)[:k])
    del items, tensors
    safe = name.replace(":", "_")
    cfg = ExtractConfig(backbones=(name,), store=str(tmp / f"{safe}-single"), batch_size=args.batch_size,
                        num_workers=args.num_workers, device=args.device, weights_dir=args.weights_dir,
                        progress=False)
    t0 = time.perf_counter()
    extract(m, cfg, source=src)
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = extract(m, cfg, source=src)
    t_hit = time.perf_counter() - t0
    assert rep.rows_computed == 0
    dec, fwd, full = n / t_dec, n / t_fwd, n / t_full
    ideal = 1.0 / (1.0 / dec + 1.0 / fwd)
    out = {
        "backbone": name, "feature_dim": bb.feature_dim, "input_size": bb.preprocess.get("input_size"),
        "images": n, "decode_img_s": round(dec, 1), "forward_img_s": round(fwd, 1), "full_extract_img_s": round(full, 1),
        "sequential_bound_img_s": round(ideal, 1), "full_over_sequential": round(full / ideal, 3),
        "cold_extract_s": round(t_full, 3), "cache_hit_s": round(t_hit, 4), "cold_over_cache_hit": round(t_full / t_hit, 1),
        **extra,
    }
    if args.dask:
        dcfg = ExtractConfig(backbones=(name,), store=str(tmp / f"{safe}-dask"), batch_size=args.batch_size,
                             num_workers=1, scheduler="local:2", device=args.device, weights_dir=args.weights_dir,
                             progress=False)
        t0 = time.perf_counter()
        extract(m, dcfg, source=src)
        t_dask = time.perf_counter() - t0
        out["dask_local2_s"] = round(t_dask, 3)
        out["single_over_dask_local2"] = round(t_full / t_dask, 3)
        out["dask_bitwise_identical"] = all(
            load_split(cfg.store, name, sp)[c].features.tobytes() == load_split(dcfg.store, name, sp)[c].features.tobytes()
            for sp in ("train", "test") for c in (cl.name for cl in m.clients))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="Office-Caltech-10 root (default: <assets>/data/office_caltech10)")
    p.add_argument("--source", default=None, help="Any image source spec instead, e.g. builtin:digits")
    p.add_argument("--per-domain", type=int, default=100, help="first N images per domain (0 = all 2,533)")
    p.add_argument("--backbones", default="resnet20-cifar10,mobilenet-v2-tflite")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (the extractor's device)")
    p.add_argument("--weights-dir", default=None, help="default: as the CLIs resolve it (benchmarks/assets.py)")
    p.add_argument("--no-dask", dest="dask", action="store_false", help="leave out the --scheduler local:2 run")
    p.add_argument("--compare-cpu", action="store_true", help="on CUDA: also time the CPU forward and compare features")
    p.add_argument("--compare-rows", type=int, default=256, help="rows for --compare-cpu")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "extract.json"))
    args = p.parse_args()
    args.weights_dir = str(assets.weights_dir(args.weights_dir))
    if args.source:
        spec = args.source
    else:
        root = Path(args.data) if args.data else assets.data_dir("office_caltech10")
        if not root.is_dir():
            raise SystemExit(f"{root}: Office-Caltech-10 not found (set EMBEDCACHE_ASSETS, --data or --source)")
        spec = f"imagefolder:{root}"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available")
    src = open_source(spec)
    m = subset_manifest(src, args.per_domain)
    tmp = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    results = []
    try:
        load_start = os.getloadavg()
        for name in args.backbones.split(","):
            r = bench_backbone(name, m, src, args, tmp)
            print(json.dumps(r))
            results.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cuda = args.device.startswith("cuda")
    out = {
        "benchmark": "extract", "data": assets.display_source(spec),
        "subset": (f"first {args.per_domain} images per domain (sorted locators), {len(m.clients)} domains"
                   if args.per_domain else "all"),
        "batch_size": args.batch_size, "num_workers": args.num_workers,
        "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "torch": torch.__version__, "device": args.device,
        "gpu": torch.cuda.get_device_name(torch.device(args.device)) if cuda else None,
        "cuda_autocast": "bfloat16 where supported, else float16 (embedcache.backbones.base.TorchBackbone)" if cuda else None,
        "torch_threads": torch.get_num_threads(), "results": results,
        "load_average_at_start": list(load_start), "load_average_at_end": list(os.getloadavg()),
    }
    if args.dask:
        out["note"] = "the dask time includes starting the LocalCluster"
    write_json(out, args.out)


if __name__ == "__main__":
    main()
