"""Vectorised engine vs per-client loop on synthetic cached features.

(a) "LP": FedAvg of a linear head (hidden=0) on 64-d features, 100 clients, Dirichlet(0.1)
    label split; (b) FedPCL (paper variant) on 3x512-d features with 5, 20 and 80 clients.
Both engines run the same algorithm definition (the loop calls client_update with M=1 per
client), on the same batches. Writes benchmarks/results/engine.json (atomic).

    python benchmarks/bench_engine.py [--rounds 3] [--quick] [--device cpu]
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click
import numpy as np
import torch

from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig
from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig
from fedheads.core import run
from fedheads.data import FedData, resolve_device
from machine_info import cpu_model  # sibling module (benchmarks/ is on sys.path)

OUT = Path(__file__).resolve().parent / "results" / "engine.json"


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
    return FedData.from_arrays(clients, C, device=device)


def time_both(make_alg, data: FedData, rounds: int, repeats: int, seed: int = 0) -> dict:
    """Best-of-`repeats` wall time per engine, engines interleaved (the box is shared)."""
    out: dict = {e: {"runs_seconds": []} for e in ("vectorized", "loop")}
    for engine in out:
        run(make_alg(), data.select(range(min(2, data.num_clients))), 1, seed, engine=engine, progress=False)  # warm-up
    for _ in range(repeats):
        for engine in out:
            if data.device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            res = run(make_alg(), data, rounds, seed, engine=engine, eval_every=rounds, progress=False)
            if data.device.type == "cuda":
                torch.cuda.synchronize()
            out[engine]["runs_seconds"].append(time.perf_counter() - t)
            out[engine]["final_mean_acc"] = float(res.final_accuracy().nanmean())
    for engine in ("vectorized", "loop"):
        out[engine]["seconds"] = min(out[engine]["runs_seconds"])
    out["speedup"] = out["loop"]["seconds"] / out["vectorized"]["seconds"]
    out["rounds"] = rounds
    out["clients"] = data.num_clients
    out["dim"] = data.dim
    out["train_samples"] = int(sum(data.n_train))
    return out


@click.command()
@click.option("--rounds", default=3, show_default=True, help="communication rounds per timing")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | auto")
@click.option("--threads", default=1, show_default=True, help="torch threads (0 = all visible cores; 1 is fastest on a shared 2-core box)")
@click.option("--repeats", default=2, show_default=True, help="timed runs per engine (best is reported)")
@click.option("--quick", is_flag=True, help="smaller federations (smoke test)")
@click.option("--out", "out_path", default=str(OUT), show_default=True, type=click.Path())
def main(rounds: int, device: str, threads: int, repeats: int, quick: bool, out_path: str) -> None:
    dev = resolve_device(device)
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    results: dict = {
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "cpu_model": cpu_model(),
        "torch": torch.__version__, "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "load_average_at_start": os.getloadavg(), "rounds": rounds, "repeats": repeats, "cases": {},
    }
    lp_clients = 20 if quick else 100
    data = synthetic(lp_clients, 64, 10, 50, 0.1, 0, dev)
    lp = lambda: FedAvg(FedAvgConfig(hidden=0), name="lp-fedavg")  # noqa: E731
    results["cases"][f"LP@{lp_clients}"] = {"algorithm": "FedAvg, linear head (LP)", "dirichlet_alpha": 0.1,
                                             **time_both(lp, data, rounds, repeats)}
    click.echo(f"LP@{lp_clients}: {results['cases'][f'LP@{lp_clients}']['speedup']:.1f}x")
    for M in ((5, 20) if quick else (5, 20, 80)):
        data = synthetic(M, 3 * 512, 10, 100, 1.0, 1, dev)
        case = time_both(lambda: FedPCL(FedPCLConfig()), data, rounds, repeats)
        results["cases"][f"FedPCL@{M}"] = {"algorithm": "FedPCL (paper variant)", "dirichlet_alpha": 1.0, **case}
        click.echo(f"FedPCL@{M}: {case['speedup']:.2f}x  (vec {case['vectorized']['seconds']:.2f}s, loop {case['loop']['seconds']:.2f}s)")
    results["load_average_at_end"] = os.getloadavg()
    target = Path(out_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True))
    os.replace(tmp, target)
    click.echo(f"wrote {target}")


if __name__ == "__main__":
    main()
