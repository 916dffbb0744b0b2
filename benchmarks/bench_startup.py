"""What a command costs beyond its own work -> benchmarks/results/startup.json.

    python benchmarks/bench_startup.py [--repeats 5] [--quick]

Each command runs as a fresh process (the console scripts of this environment), `--repeats`
times, commands interleaved within a repeat so that a load change hits them alike, page cache
warm (one untimed run of each first). Reported per command: median wall seconds and min/max, and
the ratio to `fedheads --help` (the bound for listing, describing and refusing: 3x). Describing
an algorithm is measured twice: as it runs normally (its settings text cached under
$FEDHEADS_CACHE, here a directory of the benchmark's own) and the first time (an empty cache).

Where the time goes: each command once more under `python -X importtime`, the import time of
each top-level package it loads (its modules' own time, so the figures add up); what is left is
the interpreter's start and the command's own work.

A small Fed3R run (`fedheads train` on a 4-client store of 3 classes written here) gives the
fixed cost of a command that works: wall seconds minus the load and train seconds its
results.json records.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from machine_info import cpu_model, write_json

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def _store(path: Path) -> None:
    """Four clients of 12 train / 6 test rows in 3 separable classes, 16 dims, imported."""
    import numpy as np

    from embedcache.api import import_features

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 16)) * 4
    for c in range(4):
        for split, n in (("train", 12), ("test", 6)):
            y = np.arange(n) % 3
            x = (centres[y] + rng.normal(size=(n, 16))).astype(np.float32)
            f = path.parent / f"c{c}_{split}.npz"
            np.savez(f, features=x, labels=y)
            import_features(f, path, backbone="feat16", client=f"c{c}", split=split)


def commands(store: Path, out: Path) -> dict[str, list[str]]:
    fh, ec = str(BIN / "fedheads"), str(BIN / "embedcache")
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "fedheads --help": [fh, "--help"],
        "embedcache --help": [ec, "--help"],
        "fedheads algorithms": [fh, "algorithms"],
        "fedheads algorithms fed3r": [fh, "algorithms", "fed3r"],
        "fedheads algorithms fed3r (first time)": [fh, "algorithms", "fed3r"],
        "fedheads algorithms --show": [fh, "algorithms", "--show"],
        "embedcache backbones": [ec, "backbones"],
        "fedheads train (missing store)": [fh, "train", "--store", str(store.parent / "nowhere"), "--backbones", "x",
                                           "--algorithm", "fed3r", "--out", str(out / "never")],
        "fedheads train (unknown algorithm)": [fh, "train", "--store", str(store), "--backbones", "feat16",
                                               "--algorithm", "fed3", "--out", str(out / "never")],
        "fedheads train fed3r (4 clients)": [fh, "train", "--store", str(store), "--backbones", "feat16",
                                             "--algorithm", "fed3r", "--seeds", "0", "--quiet", "--out", str(out / "run")],
    }


def _env(name: str, tmp: Path) -> dict:
    """The command's environment: a settings cache of the benchmark's own, empty for a first-time run."""
    cache = Path(tempfile.mkdtemp(dir=tmp)) if name.endswith("(first time)") else tmp / "settings-cache"
    return {**os.environ, "FEDHEADS_CACHE": str(cache)}


def _run(argv: list[str], env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if r.returncode not in (0, 2):
        raise SystemExit(f"{' '.join(argv)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return wall


def imports(argv: list[str], env: dict) -> dict[str, float]:
    """Import seconds of each top-level package the command loads, its modules' own time only
    (-X importtime's "self" column summed by package), so the figures do not nest and add up."""
    r = subprocess.run([sys.executable, "-X", "importtime", *(argv[1:] if argv[0] == sys.executable else
                        [str(BIN / Path(argv[0]).name), *argv[1:]])],
                       env=env, capture_output=True, text=True, timeout=600)
    tops: dict[str, float] = defaultdict(float)
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if m:
            tops[m.group(2).split(".")[0]] += int(m.group(1)) / 1e6
    return dict(sorted(((k, round(v, 3)) for k, v in tops.items() if v >= 0.02), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 repeats, result not written")
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        store, out = Path(tmp) / "store.zarr", Path(tmp) / "runs"
        _store(store)
        cmds = commands(store, out)
        if not (BIN / "fedheads").exists():  # the console scripts of the environment running this
            raise SystemExit(f"{BIN / 'fedheads'}: not found; run with the project's venv python")
        for name, argv in cmds.items():  # page cache warm, .pyc files written
            _run(argv, _env(name, Path(tmp)))
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {k: [] for k in cmds}
        for _ in range(repeats):
            for name, argv in cmds.items():
                times[name].append(_run(argv, _env(name, Path(tmp))))
        load_after = os.getloadavg()
        train_json = json.loads((out / "run" / "results.json").read_text())
        where = {name: imports(argv, _env(name, Path(tmp))) for name, argv in cmds.items()}
    help_median = statistics.median(times["fedheads --help"])
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"median_s": round(med, 3), "min_s": round(min(ts), 3), "max_s": round(max(ts), 3),
                      "x_help": round(med / help_median, 2), "imports_s": where[name]}
    work = _work_seconds(train_json)
    rows["fedheads train fed3r (4 clients)"]["work_s"] = round(work, 3)
    rows["fedheads train fed3r (4 clients)"]["fixed_s"] = round(
        rows["fedheads train fed3r (4 clients)"]["median_s"] - work, 3)
    res = {"method": "fresh process per run, commands interleaved, median over repeats; imports: -X importtime, "
                     "cumulative seconds of each top-level package",
           "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "python": sys.version.split()[0]},
           "repeats": repeats, "load_before": [round(x, 2) for x in load_before],
           "load_after": [round(x, 2) for x in load_after], "commands": rows}
    for name, r in rows.items():
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["imports_s"].items())[:3])
        extra = f"  (work {r['work_s']:.2f} s, fixed {r['fixed_s']:.2f} s)" if "work_s" in r else ""
        print(f"{name:36s} {r['median_s']:6.2f} s [{r['min_s']:.2f}, {r['max_s']:.2f}]  {r['x_help']:5.2f}x help  "
              f"imports: {top}{extra}")
    if not args.quick:
        write_json(res, HERE / "results" / "startup.json")


def _work_seconds(res: dict) -> float:
    """The seconds a results.json records for loading the features and training (timing.wall_seconds)."""
    return float(res["timing"]["wall_seconds"]) + float(res["timing"].get("load_wall_seconds", 0.0))


if __name__ == "__main__":
    main()
