"""The engine benchmark at two (or more) commits on one machine, interleaved A, B, A, B, ...

A speed-up measured once on a borrowed machine cannot tell a regression from the machine's spread;
running both commits back to back on the same warm machine can. Each commit is checked out into a
temporary git worktree and `benchmarks/bench_engine.py` (this checkout's copy, so both commits are
timed by the same script) runs against it. Writes benchmarks/results/engine_ab.json (or --out).

    python benchmarks/bench_engine_ab.py --commits ed3d0bc,bafa8bc --device cuda --cases FedPCL@80 \
        --repeats 3 --passes 2 --out benchmarks/results/gpu_engine_ab.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click
from machine_info import machine, write_json  # sibling module (benchmarks/ is on sys.path)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def _medians(d: dict) -> dict:
    """{threads: {case: {engine: {wall, training_round}}}}: each engine's median seconds (same fixed rounds
    at every commit, so absolute times compare across commits)."""
    out: dict = {}
    for th, cases in (d.get("by_threads") or {}).items():
        for case, c in cases.items():
            for eng in ("loop", "vectorized", "vectorised"):
                if isinstance(c.get(eng), dict):
                    out.setdefault(th, {}).setdefault(case, {})[eng] = {
                        "wall": c[eng]["wall_seconds"]["median"],
                        "training_round": c[eng]["training_round_seconds"]["median"]}
    return out


@click.command()
@click.option("--commits", required=True, help="comma-separated commits to compare (e.g. OLD,NEW)")
@click.option("--device", default="cpu", show_default=True)
@click.option("--cases", required=True, help="bench_engine.py --cases")
@click.option("--repeats", default=3, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--passes", default=2, show_default=True, help="interleaved passes over the commits")
@click.option("--own-script", is_flag=True,
              help="run each commit's own benchmarks/bench_engine.py (commits whose module paths differ)")
@click.option("--out", default=str(HERE / "results" / "engine_ab.json"), show_default=True)
def main(commits: str, device: str, cases: str, repeats: int, rounds: int, passes: int, own_script: bool,
         out: str) -> None:
    revs = [c.strip() for c in commits.split(",") if c.strip()]
    if len(revs) < 2:
        raise click.UsageError("--commits: give at least two commits")
    full = {}
    for r in revs:
        try:
            full[r] = _git("rev-parse", "--verify", f"{r}^{{commit}}")
        except subprocess.CalledProcessError:
            raise click.UsageError(f"--commits: {r!r} is not a commit of this repository") from None
    runs, by_commit = [], {r: {"speedup_wall": [], "speedup_training_round": []} for r in revs}
    with tempfile.TemporaryDirectory(prefix="engine_ab_") as tmp:
        trees = {r: Path(tmp) / r for r in revs}
        for r in revs:
            _git("worktree", "add", "--detach", str(trees[r]), full[r])
        try:
            for p in range(passes):
                for r in revs:
                    res = Path(tmp) / f"{r}-{p}.json"
                    env = {**os.environ, "PYTHONPATH": str(trees[r])}
                    script = trees[r] / "benchmarks" / "bench_engine.py" if own_script else HERE / "bench_engine.py"
                    cmd = [sys.executable, str(script), "--device", device, "--cases", cases,
                           "--repeats", str(repeats), "--rounds", str(rounds), "--out", str(res)]
                    click.echo(f"pass {p + 1}/{passes}, {r}: {' '.join(cmd[1:])}", err=True)
                    subprocess.run(cmd, env=env, check=True, cwd=trees[r])
                    d = json.loads(res.read_text())
                    run = {"commit": r, "order": len(runs) + 1, "speedup": d.get("speedup"),
                           "speedup_training_round": d.get("speedup_training_round"), "seconds": _medians(d)}
                    runs.append(run)
                    for key, dst in (("speedup", "speedup_wall"), ("speedup_training_round", "speedup_training_round")):
                        by_commit[r][dst].append(d.get(key))
        finally:
            for r in revs:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees[r])], cwd=REPO, capture_output=True)
    write_json({"benchmark": f"bench_engine.py at {len(revs)} commits on one machine, interleaved",
                "script": "each commit's own" if own_script else "this checkout's", "device": device,
                "cases": cases, "rounds": rounds, "repeats": repeats, "machine": machine(device),
                "load_average_at_end": list(os.getloadavg()), "runs": runs, "by_commit": by_commit}, out)
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
