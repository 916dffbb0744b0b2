"""Wall time of the reproduction pipelines (issue 8, "Benchmarks and figures"): each experiment run
with `python -m pipelines run NAME --scale SCALE --scheduler SCHED`, first cold (partition and
extraction into the run's cache included), then again with `--force` from the warm cache (every
cell re-trained, features read from the store): prepare seconds, sweep seconds and the sum of the
cells' own wall and CPU seconds per experiment; optionally the warm pass once more under a second
scheduler (e.g. `serial` against `local:2`). Writes benchmarks/results/pipelines.json after each
experiment, so a run cut short keeps what it measured.

Usage: python benchmarks/bench_pipelines.py [--experiments 'fedpcl-*'] [--scale ci]
           [--scheduler local:2] [--compare serial] [--out-dir DIR [--warm-only]] [--out FILE]
(paper scale from the ci run's warm cache: --scale paper --out-dir DIR --warm-only
 --out benchmarks/results/pipelines_paper.json)
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
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", default="fedpcl-*")
    ap.add_argument("--scale", default="ci")
    ap.add_argument("--scheduler", default="local:2")
    ap.add_argument("--compare", default="", help="a second scheduler for the warm pass (e.g. serial)")
    ap.add_argument("--out-dir", default=None, help="pipeline output and cache (default: a temp dir)")
    ap.add_argument("--warm-only", action="store_true",
                    help="skip the cold pass: --out-dir's cache already holds the features (e.g. from a ci run)")
    ap.add_argument("--out", default=str(HERE / "results" / "pipelines.json"))
    a = ap.parse_args()
    out = Path(a.out_dir or tempfile.mkdtemp(prefix="bench_pipelines_"))
    res = {"benchmark": "pipelines", "scale": a.scale, "scheduler": a.scheduler, "machine": machine("cpu"),
           "load_average_before": os.getloadavg(), "experiments": {}}
    for name in names(a.experiments):
        r = {} if a.warm_only else {"cold": run_one(name, a.scale, a.scheduler, out, force=False)}
        r["warm"] = run_one(name, a.scale, a.scheduler, out, force=True)
        if a.compare:
            r[f"warm_{a.compare}"] = run_one(name, a.scale, a.compare, out, force=True)
        res["experiments"][name] = r
        res["load_average_after"] = os.getloadavg()
        w = r["warm"].get("timing", {})
        cold = f"cold {r['cold']['process_seconds']:.0f} s, " if "cold" in r else ""
        print(f"{name}: {cold}warm sweep {w.get('sweep_seconds', float('nan')):.0f} s "
              f"({w.get('cells', '?')} cells)", flush=True)
        write_json(res, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
