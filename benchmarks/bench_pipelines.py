"""Wall time of the reproduction pipelines: each experiment run
with `python -m pipelines run NAME --scale SCALE --scheduler SCHED`, first cold (partition and
extraction into the run's cache included), then again with `--force` from the warm cache (every
cell re-trained, features read from the store): prepare seconds, sweep seconds and the sum of the
cells' own wall and CPU seconds per experiment; optionally the warm pass once more under a second
scheduler (e.g. `serial` against `local:2`). Writes benchmarks/results/pipelines.json after each
experiment, so a run cut short keeps what it measured.

Usage: python benchmarks/bench_pipelines.py [--experiments 'fedpcl-*'] [--scale ci]
           [--scheduler local:2] [--compare serial] [--out-dir DIR [--warm-only]
           [--retrain ALG,ALG]] [--out FILE]
(paper scale from the ci run's warm cache: --scale paper --out-dir DIR --warm-only
 --out benchmarks/results/pipelines_paper.json)
--retrain: after a change to some algorithms only, re-train just their cells: their result files
in DIR are removed and the experiments run without --force, so every other cell keeps its result
and CPU time from the run before; the summary sums all of them (say so where the figures go).
Run on an otherwise idle machine.
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

from machine_info import machine, write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def names(pattern: str) -> list[str]:
    sys.path.insert(0, str(REPO))
    from pipelines.registry import select

    out: list[str] = []
    for p in pattern.split(","):  # in the order given (cheap experiments first, if a run may be cut)
        out += [e.name for e in select([p]) if e.name not in out]
    return out


def drop_cells(out: Path, name: str, algorithms: set[str], retrained: set[str]) -> list[str]:
    """Remove the result files of experiment `name`'s cells (its last results.json in `out`) that
    train one of `algorithms`, so a run without --force re-trains exactly those; cells already
    re-trained by this run for an earlier experiment (shared by hash) are kept."""
    rows = json.loads((out / name / "results.json").read_text()).get("cells", [])
    dropped = []
    for h in sorted({r["hash"] for r in rows if r.get("hash")} - retrained):
        f = out / "cells" / f"{h}.json"
        if f.is_file() and json.loads(f.read_text()).get("config", {}).get("algorithm") in algorithms:
            f.unlink()
            dropped.append(h)
    return dropped


def run_one(name: str, scale: str, scheduler: str, out: Path, force: bool) -> dict:
    cmd = [sys.executable, "-m", "pipelines", "run", name, "--scale", scale, "--scheduler", scheduler,
           "--out", str(out), "--quiet"] + (["--force"] if force else [])
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t
    shown = " ".join(cmd[1:]).replace(str(out), "OUT_DIR")  # no path of this machine in the JSON
    res: dict = {"command": shown, "rc": p.returncode, "process_seconds": round(wall, 2)}
    if p.returncode != 0:
        res["error"] = p.stderr.strip().splitlines()[-1:] if p.stderr.strip() else []
    plan = out / name / "plan.json"
    if plan.is_file():
        res["timing"] = json.loads(plan.read_text()).get("timing", {})
    cells = out / name / "results.json"
    if cells.is_file():
        rows = json.loads(cells.read_text()).get("cells", [])
        res["cells_wall_seconds"] = round(sum((r.get("wall_seconds") or 0) for r in rows), 2)
        res["cells_done"] = sum(1 for r in rows if r.get("status") == "done")
        res["cell_hashes"] = sorted({r["hash"] for r in rows if r.get("hash")})  # popped by main
    return res


def cell_cpu(out: Path, hashes: list[str]) -> dict[str, tuple[str, float]]:
    """(algorithm, CPU seconds) of the given cells, from their result files (docs/contracts.md,
    section 9)."""
    got = {}
    for h in hashes:
        f = out / "cells" / f"{h}.json"
        if f.is_file():
            d = json.loads(f.read_text())
            got[h] = (d.get("config", {}).get("algorithm", "?"), float(d.get("timing", {}).get("cpu_seconds") or 0.0))
    return got


def summary(res: dict, cpu: dict[str, tuple[str, float]]) -> dict:
    """Sums over the experiments, and over their distinct cells: experiments share cells by
    hash, so the distinct cells' CPU time is what one sweep over all of them trains."""
    warm = [x["warm"]["timing"] for x in res["experiments"].values() if "timing" in x["warm"]]
    per_alg: dict[str, float] = {}
    for alg, sec in cpu.values():
        per_alg[alg] = per_alg.get(alg, 0.0) + sec
    other = {k for x in res["experiments"].values() for k in x if k.startswith("warm_")}
    compare = {k[5:]: round(sum(x[k].get("timing", {}).get("sweep_seconds", 0) for x in res["experiments"].values()
                                if k in x) / 60, 2) for k in sorted(other)}
    return {"sweep_minutes_sum_of_experiments": round(sum(t.get("sweep_seconds", 0) for t in warm) / 60, 2),
            **({"sweep_minutes_sum_under": compare} if compare else {}),
            "cells_per_experiment_total": sum(t.get("cells", 0) for t in warm),
            "unique_cells": len(cpu), "unique_cell_cpu_minutes": round(sum(v for _, v in cpu.values()) / 60, 2),
            "cpu_minutes_per_algorithm": {k: round(v / 60, 2) for k, v in sorted(per_alg.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", default="fedpcl-*")
    ap.add_argument("--scale", default="ci")
    ap.add_argument("--scheduler", default="local:2")
    ap.add_argument("--compare", default="", help="a second scheduler for the warm pass (e.g. serial)")
    ap.add_argument("--out-dir", default=None, help="pipeline output and cache (default: a temp dir)")
    ap.add_argument("--warm-only", action="store_true",
                    help="skip the cold pass: --out-dir's cache already holds the features (e.g. from a ci run)")
    ap.add_argument("--retrain", default="", help="comma-separated algorithms: re-train only their cells (docstring)")
    ap.add_argument("--out", default=str(HERE / "results" / "pipelines.json"))
    a = ap.parse_args()
    retrain = {x for x in a.retrain.split(",") if x}
    if retrain and not (a.out_dir and a.warm_only):
        ap.error("--retrain needs --out-dir DIR --warm-only (the cells of the run before)")
    out = Path(a.out_dir or tempfile.mkdtemp(prefix="bench_pipelines_"))
    res = {"benchmark": "pipelines", "scale": a.scale, "scheduler": a.scheduler, "machine": machine("cpu"),
           "load_average_before": os.getloadavg(), "experiments": {},
           **({"retrained_algorithms": sorted(retrain)} if retrain else {})}
    cpu: dict[str, tuple[str, float]] = {}  # cell hash -> (algorithm, CPU seconds of its warm pass)
    retrained: set[str] = set()  # --retrain: cells re-trained so far
    for name in names(a.experiments):
        r = {} if a.warm_only else {"cold": run_one(name, a.scale, a.scheduler, out, force=False)}
        if retrain:
            dropped = drop_cells(out, name, retrain, retrained)
            retrained.update(dropped)
            r["retrained_cells"] = len(dropped)
        r["warm"] = run_one(name, a.scale, a.scheduler, out, force=not retrain)
        fresh = [h for h in r["warm"].get("cell_hashes", []) if h not in cpu]
        cpu.update(cell_cpu(out, fresh))  # read before a --compare pass re-runs them
        if a.compare:
            r[f"warm_{a.compare}"] = run_one(name, a.scale, a.compare, out, force=True)
        for x in r.values():
            if isinstance(x, dict):
                x.pop("cell_hashes", None)
        res["experiments"][name] = r
        res["load_average_after"] = os.getloadavg()
        res["summary"] = summary(res, cpu)
        w = r["warm"].get("timing", {})
        cold = f"cold {r['cold']['process_seconds']:.0f} s, " if "cold" in r else ""
        print(f"{name}: {cold}warm sweep {w.get('sweep_seconds', float('nan')):.0f} s "
              f"({w.get('cells', '?')} cells)", flush=True)
        write_json(res, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
