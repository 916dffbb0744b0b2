"""End-to-end batch prediction from new images: images/s of `fedheads predict --images` (extract
through the run's backbone + classify + write the file), with a cold cache (a fresh --cache each
repeat: every image decoded and embedded) and a warm one (the same --cache again: one sha256 per image
for the drift check, then the classification) -> benchmarks/results/predict_images.json.

    EMBEDCACHE_ASSETS=../shared python benchmarks/bench_predict_images.py [--per-domain 60]
        [--backbone resnet20-cifar10] [--algorithm fedncm] [--repeats 5] [--device cpu] [--quick]

Setup (not timed): the first `--per-domain` images of each Office-Caltech-10 domain
(imagefolder:<assets>/data/office_caltech10, one client per domain, round-robin over the classes,
every third image to test), extracted into a store and trained on for 1 round (`--algorithm`, which must
have a global model: fedncm, lp, fedavg). The test images are then copied into a NEW folder of
class sub-folders (so accuracy is reported too) and predicted with the run's global model, each
call as a user's command pays it: opening the run, creating the backbone (weights load, identity
check), drift check, extraction, faiss/head classification, the CSV written atomically.

Reported per mode: median images/s and the min/max over the repeats, the accuracy, the warm/cold
speed-up, the process's peak RSS and the load average (the machine may be shared: the lead
re-measures on an idle machine). --quick: 30 images per domain, 2 repeats (checks that it runs).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import assets  # sibling modules (benchmarks/ is on sys.path)
from machine_info import machine_facts, write_json

import embedcache
import fedheads
from embedcache.manifest import Client, Manifest, Sample
from embedcache.sources import open_source

HERE = Path(__file__).resolve().parent


def spread_manifest(src, per_domain: int) -> Manifest:
    """One client per domain over `per_domain` of its images taken round-robin over the classes
    (sorted locators within a class; 0: all), every third image to test."""
    clients = []
    by: dict[str, dict[int, list[str]]] = {}
    for domain, locator, label in src.index():
        by.setdefault(domain, {}).setdefault(label, []).append(locator)
    for d in sorted(by):
        queues = [sorted(by[d][k]) for k in sorted(by[d])]
        picked: list[Sample] = []
        while any(queues) and (not per_domain or len(picked) < per_domain):
            for k, q in zip(sorted(by[d]), queues):
                if q and (not per_domain or len(picked) < per_domain):
                    loc = q.pop(0)
                    picked.append(Sample(loc, loc, k))
        clients.append(Client(f"c-{d}", d, tuple(s for i, s in enumerate(picked) if i % 3),
                              tuple(s for i, s in enumerate(picked) if i % 3 == 0)))
    return Manifest(src.spec, tuple(src.classes()), tuple(clients), recipe={"bench": "predict_images"})


def new_image_folder(manifest, src_root: Path, dest: Path) -> int:
    """Every test image of the manifest copied to dest/<class>/<domain>_<file>; returns the count."""
    n = 0
    for c in manifest.clients:
        for s in c.test:
            target = dest / manifest.classes[s.label] / f"{c.domain}_{Path(s.locator).name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src_root / s.locator, target)
            n += 1
    return n


def timed(fn) -> tuple[tuple[float, float], object]:
    """((wall, process CPU of all threads) seconds, fn())."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return (time.perf_counter() - t, time.process_time() - c), out


def spread(n: int, secs: list[tuple[float, float]]) -> dict:
    rates = [n / w for w, _ in secs]
    return {"images_per_s_median": round(statistics.median(rates), 2), "images_per_s_min": round(min(rates), 2),
            "images_per_s_max": round(max(rates), 2), "wall_seconds": [round(w, 3) for w, _ in secs],
            "cpu_seconds": [round(c, 3) for _, c in secs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default=None, help="imagefolder:PATH (default: Office-Caltech-10 in the assets)")
    ap.add_argument("--per-domain", type=int, default=60, help="images per domain (0: all)")
    ap.add_argument("--backbone", default="resnet20-cifar10")
    ap.add_argument("--algorithm", default="fedncm", help="one with a global model (fedncm, lp, fedavg)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--weights-dir", default=None)
    ap.add_argument("--quick", action="store_true", help="30 images per domain, 2 repeats")
    ap.add_argument("--out", default=str(HERE / "results" / "predict_images.json"))
    a = ap.parse_args()
    per_domain, repeats = (30, 2) if a.quick else (a.per_domain, a.repeats)
    spec = a.source or f"imagefolder:{assets.data_dir('office_caltech10')}"
    if not Path(spec.partition(":")[2]).is_dir():
        sys.exit(f"error: {spec}: not found (set EMBEDCACHE_ASSETS or --source imagefolder:PATH)")
    weights = str(assets.weights_dir(a.weights_dir))
    src = open_source(spec)
    manifest = spread_manifest(src, per_domain)
    with tempfile.TemporaryDirectory(prefix="bench-predict-images-") as tmp_:
        tmp = Path(tmp_)
        embedcache.extract(manifest, a.backbone, tmp / "train.zarr", device=a.device, weights_dir=weights,
                           progress=False)
        fedheads.train(tmp / "train.zarr", a.algorithm, backbones=a.backbone, rounds=1, seeds=0,
                       device=a.device, out=tmp / "run")
        n = new_image_folder(manifest, Path(spec.partition(":")[2]), tmp / "new")
        kw = dict(images=f"imagefolder:{tmp / 'new'}", device=a.device, weights_dir=weights, out=tmp / "p.csv")
        cold, warm, acc = [], [], None
        for r in range(repeats):
            secs, done = timed(lambda r=r: fedheads.predict(tmp / "run", cache=tmp / f"cache{r}", **kw))
            cold.append(secs)
            acc = done.per_client["(global)"]["accuracy"]
            warm.append(timed(lambda r=r: fedheads.predict(tmp / "run", cache=tmp / f"cache{r}", **kw))[0])
            shutil.rmtree(tmp / f"cache{r}")
    result = {
        "benchmark": "fedheads predict --images end to end (extract + classify + write)",
        "quick": a.quick, "source": assets.display(spec.partition(":")[2]), "backbone": a.backbone,
        "algorithm": a.algorithm, "classifier": "global model", "images": n, "repeats": repeats,
        "cold": spread(n, cold), "warm": spread(n, warm),
        "warm_over_cold_speedup_median": round(statistics.median(w for w, _ in cold) /
                                               statistics.median(w for w, _ in warm), 2),
        "accuracy_percent": acc,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "load_average_at_end": os.getloadavg(), **machine_facts(), "device": a.device,
    }
    write_json(result, a.out)
    print(result)


if __name__ == "__main__":
    main()
