"""Vectorised engine vs per-client loop on synthetic cached features.

Cases: (a) "LP": FedAvg of a linear head (hidden=0) on 64-d features, 100 clients, Dirichlet(0.1)
label split; (b) FedPCL (paper variant) on 3x512-d features with 5, 20 and 80 clients (~100 rows
each). Both engines run the same algorithm definition (the loop calls client_update with M=1 per
client) on the same batches, so they also reach the same accuracy (recorded).

Method (a figure that a second run on an idle machine reproduces):
  * every case is timed for `--threads` settings (default on CPU: 1 thread AND all visible cores,
    on CUDA all cores; both engines always use the same number of torch threads);
  * per case, one warm-up run of each engine is discarded; the number of rounds is then chosen
    so that one vectorised run takes >= `--min-seconds` (the loop takes longer), at least
    `--min-rounds`, capped so one loop run stays under `--max-seconds`;
  * `--repeats` timed runs per engine (default 7), engines interleaved within each repeat and
    their order alternated between repeats, so drifting load hits both alike;
  * per engine: median, quartiles/IQR, min, max of wall and process-CPU seconds of whole runs
    (init, all rounds, final evaluation); the speed-up is median(loop) / median(vectorised),
    with the median and IQR of the per-repeat ratios loop_i / vectorised_i as its spread;
  * also per training round (the median over a run's rounds after the first of the engine's
    per-round training time): what a 50-200-round run converges to, without init/evaluation;
  * recorded: threads, cores, CPU model, load average before/after each case, torch, device.
Writes benchmarks/results/engine.json (atomic). `--device cuda` runs the same cases on a GPU
(clocks read after torch.cuda.synchronize()).

    python benchmarks/bench_engine.py [--threads 1,all] [--repeats 7] [--device cpu] [--quick]
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
import torch
from machine_info import machine, write_json  # sibling module (benchmarks/ is on sys.path)

from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig
from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig
from fedheads.core import run
from fedheads.core.engine import clock
from fedheads.core.federation import FedData
from fedheads.run.load import from_arrays, resolve_device

OUT = Path(__file__).resolve().parent / "results" / "engine.json"
ENGINES = ("vectorized", "loop")


def synthetic(M: int, D: int, C: int, per_client: int, alpha: float | None, seed: int, device: torch.device) -> FedData:
    """Gaussian class clusters; labels per client from Dirichlet(alpha) (None = uniform)."""
    rs = np.random.default_rng(seed)
    centers = rs.normal(size=(C, D)).astype("f4")
    clients = []
    for _ in range(M):
        pc = rs.dirichlet([alpha] * C) if alpha else np.full(C, 1.0 / C)
        n = max(2, int(rs.poisson(per_client)))
        y = rs.choice(C, size=n, p=pc)
        yt = rs.choice(C, size=max(2, n // 4), p=pc)
        mk = lambda yy: (centers[yy] + rs.normal(size=(len(yy), D)).astype("f4"))  # noqa: E731
        clients.append((mk(y), y, mk(yt), yt))
    return from_arrays(clients, C, device=device)


def spread(xs: list[float]) -> dict:
    """Median, quartiles, IQR, min, max and the samples themselves."""
    q1, med, q3 = (float(v) for v in np.percentile(xs, [25, 50, 75]))
    return {"median": med, "q1": q1, "q3": q3, "iqr": q3 - q1, "min": float(min(xs)), "max": float(max(xs)),
            "samples": [float(x) for x in xs]}


def timed_run(make_alg: Callable, data: FedData, rounds: int, engine: str) -> dict:
    """Wall and CPU seconds of one whole run, the median training time of its rounds after the
    first (FedPCL's round 0 only collects prototypes) and the final mean accuracy."""
    t0 = clock(data.device)
    res = run(make_alg(), data, rounds, 0, engine=engine, eval_every=rounds, progress=False)
    t1 = clock(data.device)
    later = [r.seconds for r in res.history[1:]] or [res.history[0].seconds]
    return {"wall": t1[0] - t0[0], "cpu": t1[1] - t0[1], "round": statistics.median(later),
            "acc": float(res.final_accuracy().nanmean())}


def time_case(make_alg: Callable, data: FedData, repeats: int, min_seconds: float, rounds: int = 0,
              max_seconds: float = 15.0, min_rounds: int = 5) -> dict:
    """Warm up, pick the rounds (unless given), then time both engines `repeats` times, interleaved.

    Rounds: at least `min_rounds`, and enough for one vectorised run to take `min_seconds`, but
    no more than keep one loop run under `max_seconds` (on a GPU the loop is orders of magnitude
    slower)."""
    warm = {e: timed_run(make_alg, data, 2, e) for e in ENGINES}  # discarded (allocator, caches, lazy init)
    if rounds <= 0:
        vec, loop = (max(warm[e]["round"], 1e-6) for e in ENGINES)
        rounds = max(min_rounds, min(math.ceil(min_seconds / vec), int(max_seconds / loop)))
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for i in range(repeats):
        for e in (ENGINES if i % 2 == 0 else ENGINES[::-1]):
            runs[e].append(timed_run(make_alg, data, rounds, e))
    col = lambda e, k: [r[k] for r in runs[e]]  # noqa: E731
    out: dict = {e: {"wall_seconds": spread(col(e, "wall")), "cpu_seconds": spread(col(e, "cpu")),
                     "training_round_seconds": spread(col(e, "round")), "final_mean_acc": runs[e][-1]["acc"]}
                 for e in ENGINES}
    med = lambda e, k: statistics.median(col(e, k))  # noqa: E731
    out["speedup"] = med("loop", "wall") / med("vectorized", "wall")
    out["speedup_per_repeat"] = spread([lo / ve for lo, ve in zip(col("loop", "wall"), col("vectorized", "wall"))])
    out["speedup_cpu"] = med("loop", "cpu") / med("vectorized", "cpu")
    out["speedup_training_round"] = med("loop", "round") / med("vectorized", "round")
    out["speedup_training_round_per_repeat"] = spread(
        [lo / ve for lo, ve in zip(col("loop", "round"), col("vectorized", "round"))])
    out.update(rounds=rounds, clients=data.num_clients, dim=data.dim, train_samples=int(sum(data.n_train)),
               load_average_before=list(load_before), load_average_after=list(os.getloadavg()))
    return out


def cases(quick: bool, dev: torch.device) -> list[tuple[str, dict, Callable, Callable[[], FedData]]]:
    """(name, description, algorithm factory, data factory) of every case, the headline first."""
    lp_m = 20 if quick else 100
    pcl = [(f"FedPCL@{M}", {"algorithm": "FedPCL (paper variant)", "dirichlet_alpha": 1.0},
            lambda: FedPCL(FedPCLConfig()), lambda M=M: synthetic(M, 3 * 512, 10, 100, 1.0, 1, dev))
           for M in ((20, 5) if quick else (80, 20, 5))]
    lp = (f"LP@{lp_m}", {"algorithm": "FedAvg, linear head (LP)", "dirichlet_alpha": 0.1},
          lambda: FedAvg(FedAvgConfig(hidden=0), name="lp-fedavg"), lambda: synthetic(lp_m, 64, 10, 50, 0.1, 0, dev))
    return [pcl[0], lp, *pcl[1:]]


def parse_threads(spec: str) -> list[int]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out = []
    for tok in spec.split(","):
        n = cores if tok.strip() in ("all", "0") else int(tok)
        if n < 1:
            raise click.BadParameter(f"{tok}: threads must be >= 1 or 'all'")
        if n not in out:
            out.append(n)
    return out


def write(results: dict, path: Path) -> None:
    """The JSON so far, atomically (after every case: a run stopped by a time limit keeps its cases)."""
    blocks = results["by_threads"].items()
    for key, field in (("speedup", "speedup"), ("speedup_training_round", "speedup_training_round")):
        results[key] = {f"threads={n}": {name: round(c[field], 3) for name, c in b.items()} for n, b in blocks}
    write_json(results, path)


@click.command()
@click.option("--threads", "threads_spec", default=None,
              help="comma-separated torch thread counts to measure ('all' = every visible core); "
                   "default '1,all' on CPU, 'all' on CUDA")
@click.option("--repeats", default=None, type=int, help="timed runs per engine and case [default: 7 on CPU, 5 on CUDA]")
@click.option("--min-seconds", default=1.0, show_default=True, help="rounds are chosen so one vectorised run takes this long")
@click.option("--rounds", default=0, show_default=True, help="fixed rounds per run (0 = chosen from --min-seconds)")
@click.option("--max-seconds", default=None, type=float,
              help="cap on the rounds: one loop run takes at most this long [default: 15 on CPU, 2 on CUDA]")
@click.option("--min-rounds", default=5, show_default=True, help="at least this many rounds per run")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | auto")
@click.option("--cases", "only", default="", help="comma-separated case names to run (default: all)")
@click.option("--quick", is_flag=True, help="smaller federations, 3 repeats (smoke test, not a figure)")
@click.option("--out", "out_path", default=str(OUT), show_default=True, type=click.Path())
def main(threads_spec: str | None, repeats: int | None, min_seconds: float, rounds: int, max_seconds: float | None,
         min_rounds: int, device: str, only: str, quick: bool, out_path: str) -> None:
    dev = resolve_device(device)
    cuda = dev.type == "cuda"  # the loop is ~100x slower there: fewer, shorter loop runs
    threads_spec = threads_spec or ("all" if cuda else "1,all")
    repeats = repeats or (5 if cuda else 7)
    max_seconds = max_seconds or (2.0 if cuda else 15.0)
    if quick:
        repeats, min_seconds, min_rounds = min(repeats, 3), 0.0, 2
    threads = parse_threads(threads_spec)
    mach = machine(dev)
    mach.pop("threads")  # set per block below
    results: dict = {
        "method": __doc__.split("Method", 1)[1].split("Writes", 1)[0].strip(), "machine": mach,
        "repeats": repeats, "min_seconds": min_seconds, "max_seconds": max_seconds, "min_rounds": min_rounds,
        "quick": quick, "threads": threads, "load_average_at_start": list(os.getloadavg()), "by_threads": {},
    }
    wanted = {c.strip() for c in only.split(",") if c.strip()}
    target = Path(out_path)
    for n in threads:
        torch.set_num_threads(n)
        block: dict = results["by_threads"].setdefault(str(n), {})
        for name, desc, make_alg, make_data in cases(quick, dev):
            if wanted and name not in wanted:
                continue
            case = time_case(make_alg, make_data(), repeats, min_seconds, rounds, max_seconds, min_rounds)
            block[name] = {**desc, **case}
            sp, tr = case["speedup_per_repeat"], case["speedup_training_round"]
            click.echo(f"threads={n} {name}: {case['speedup']:.2f}x whole run (per-repeat median {sp['median']:.2f}, "
                       f"IQR {sp['q1']:.2f}-{sp['q3']:.2f}), {tr:.2f}x per training round; "
                       f"vec {case['vectorized']['wall_seconds']['median']:.2f}s, "
                       f"loop {case['loop']['wall_seconds']['median']:.2f}s, {case['rounds']} rounds, "
                       f"load {case['load_average_before'][0]:.1f}->{case['load_average_after'][0]:.1f}")
            results["load_average_at_end"] = list(os.getloadavg())
            write(results, target)
    click.echo(f"wrote {target}")


if __name__ == "__main__":
    main()
