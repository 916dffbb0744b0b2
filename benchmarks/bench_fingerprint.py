"""What an image fingerprint costs next to decoding the image (contract 2: `embedcache partition`
takes every sample's fingerprint and `embedcache extract` takes it again before every run, cache
hits included) -> benchmarks/results/fingerprint.json.

    EMBEDCACHE_ASSETS=../shared python benchmarks/bench_fingerprint.py [--limit 0] [--repeats 5]

Over the Office-Caltech-10 images (imagefolder:<assets>/data/office_caltech10; --limit N: the
first N locators, 0 = all), one pass per method and repeat, methods interleaved within a repeat
so that a load change hits them alike, page cache warm (an untimed read of every file first):
  * stat            : os.stat (the "stat" kind: size + mtime, what a same-size `cp -p` fools);
  * read            : the file's bytes only (the floor of every content hash);
  * sha256, blake2b : read + hashlib (blake2b at its default 64-byte digest), xxh3_128 when the
                      `xxhash` package is installed (it is not a dependency);
  * fingerprint_all : embedcache.sources.drift.fingerprint_all with the default kind, as extract
                      calls it (threads above 64 images);
  * decode          : ImageFolder.load (PIL open + decode + 8-bit RGB), what extract pays per image.
Reported per method: median seconds per pass and min/max over the repeats, microseconds per
image, MB/s, and decode / method (how many fingerprints one decode pays for); load averages
before and after (the machine may be shared). --quick: 200 images, 2 repeats, result not written.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import assets  # sibling modules (benchmarks/ is on sys.path)
from machine_info import cpu_model, write_json

from embedcache.partitioning import Recipe
from embedcache.sources.drift import fingerprint_all
from embedcache.sources.imagefolder import ImageFolder

HERE = Path(__file__).resolve().parent


def _hasher(name: str):
    if name == "xxh3_128":
        import xxhash

        return lambda b: xxhash.xxh3_128_hexdigest(b)
    return lambda b: hashlib.new(name, b).hexdigest()


def methods(src: ImageFolder, paths: list[str], locs: list[str]) -> dict:
    """name -> a function of no argument doing one pass over every image."""
    def read_all():
        for p in paths:
            with open(p, "rb") as f:
                f.read()

    def hash_all(h):
        def run():
            for p in paths:
                with open(p, "rb") as f:
                    h(f.read())
        return run

    out = {"stat": lambda: [os.stat(p) for p in paths], "read": read_all}
    names = ["sha256", "blake2b"]
    try:
        import xxhash  # noqa: F401

        names.append("xxh3_128")
    except ImportError:
        pass
    for n in names:
        out[n] = hash_all(_hasher(n))
    kind = Recipe(scheme="feature-shift").fingerprint
    out[f"fingerprint_all ({kind})"] = lambda: fingerprint_all(src, locs, kind)
    out["decode"] = lambda: [src.load(loc) for loc in locs]
    return out


def commit() -> str:
    """HEAD's short hash, "+dirty" when the tree has uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=0, help="first N images (0: all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "fingerprint.json"))
    a = ap.parse_args()
    limit, repeats = (200, 2) if a.quick else (a.limit, a.repeats)
    root = assets.data_dir("office_caltech10")
    if not root.is_dir():
        sys.exit(f"{root}: not found (set EMBEDCACHE_ASSETS to the folder holding data/office_caltech10)")
    src = ImageFolder(f"imagefolder:{root}", str(root))
    locs = [loc for _, loc, _ in src.index()]
    locs = locs[:limit] if limit else locs
    paths = [str(root / loc) for loc in locs]
    nbytes = sum(os.path.getsize(p) for p in paths)
    load_before = os.getloadavg()
    run = methods(src, paths, locs)
    run["read"]()  # page cache warm for every method
    secs: dict[str, list[float]] = {k: [] for k in run}
    for _ in range(repeats):
        for name, fn in run.items():
            t = time.perf_counter()
            fn()
            secs[name].append(time.perf_counter() - t)
    n = len(paths)
    dec = statistics.median(secs["decode"])
    res = {}
    for name, s in secs.items():
        med = statistics.median(s)
        res[name] = {"median_s": round(med, 4), "min_s": round(min(s), 4), "max_s": round(max(s), 4),
                     "us_per_image": round(med / n * 1e6, 1), "mb_per_s": round(nbytes / med / 1e6, 1),
                     "decode_over_this": round(dec / med, 1), "repeats_s": [round(x, 4) for x in s]}
    result = {
        "benchmark": "image fingerprint kinds vs decoding the image (warm page cache)",
        "command": shlex.join(["python", "benchmarks/bench_fingerprint.py", *sys.argv[1:]]),
        "commit": commit(), "source": assets.display(str(root)), "images": n,
        "mean_image_bytes": round(nbytes / n), "repeats": repeats, "methods": res,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
                    "python": sys.version.split()[0], "openssl": __import__("ssl").OPENSSL_VERSION},
    }
    if not a.quick:
        write_json(result, a.out)
    for name, r in res.items():
        print(f"{name:>24}: {r['median_s']:.4f} s/pass [{r['min_s']:.4f}, {r['max_s']:.4f}]  "
              f"{r['us_per_image']:8.1f} us/image  {r['mb_per_s']:8.1f} MB/s  decode/this {r['decode_over_this']}")


if __name__ == "__main__":
    main()
