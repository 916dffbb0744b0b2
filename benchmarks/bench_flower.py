"""Seconds and bytes per round over Flower, plain vs SecAgg+, against the in-process engine.

Cases, on one synthetic store (N clients x rows x dim, C classes; each node gets its own store
holding only its client, as on separate machines):
  * engine      : fedheads' loop engine in this process (each client M=1, no network);
  * simulation  : Flower's simulation runtime in this process (fedheads simulate), plain / SecAgg+;
  * loopback    : real processes on 127.0.0.1 (fedheads serve + N x fedheads join), plain / SecAgg+:
                  every Flower message starts a ClientApp process on its node (Flower 1.41's design).
Per case: seconds per training round (updates + aggregation; evaluation excluded) and bytes per
round (everything Flower serialised, both directions; the engine's figure is its payload
accounting). Median and spread over --repeats; the JSON records the load average before and
after each case (the machine may be shared).

Usage: python benchmarks/bench_flower.py [--quick] [--algorithms fedncm,fedpcl] [--nodes 3]
                                         [--cases engine,simulation,loopback] [--out PATH]
Writes benchmarks/results/flower.json (--quick: flower_quick.json). Peak memory is recorded per
case as the running maxima of this process and its children (ru_maxrss), so it only grows."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from machine_info import machine_facts, write_json  # sibling module (benchmarks/ is on sys.path)

from embedcache.store.importer import import_features

HERE = Path(__file__).resolve().parent


def write_stores(root: Path, nodes: int, rows: int, dim: int, classes: int) -> tuple[Path, list[Path]]:
    """The union store and one store per node (its client only), identical features."""
    rng = np.random.default_rng(0)
    means = rng.normal(size=(classes, dim))
    union, own = root / "union.zarr", []
    for k in range(nodes):
        c = f"c{k:02d}"
        for split, n in (("train", rows), ("test", max(2, rows // 4))):
            y = rng.integers(0, classes, n)
            x = (means[y] + rng.normal(size=(n, dim))).astype(np.float32)
            f = root / f"{split}.npz"
            np.savez(f, features=x, labels=y)
            for store in (union, root / f"{c}.zarr"):
                import_features(store, f, backbone="synth", client=c, split=split, classes=[str(i) for i in range(classes)])
        own.append(root / f"{c}.zarr")
    return union, own


CASES = ("engine", "simulation", "loopback")


def peak_rss() -> dict[str, int]:
    """Peak resident memory so far of this process and of its largest finished child (bytes)."""
    import resource

    kib = 1024  # Linux reports ru_maxrss in KiB
    return {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib}


def per_round(rounds: list[dict]) -> tuple[float, float]:
    return (statistics.median(r["train_seconds"] for r in rounds),
            statistics.median(r["sent_bytes"] + r["received_bytes"] for r in rounds))


def engine_case(union: Path, alg: str, rounds: int) -> tuple[float, float]:
    from fedheads.core.engine import run
    from fedheads.run.load import load_fed_data
    from fedheads.run.train import TrainOptions, build_algorithm

    a, _, _ = build_algorithm(alg, TrainOptions(), strict=True)
    res = run(a, load_fed_data(str(union), ["synth"], "cpu"), rounds, engine="loop", eval_every=0, progress=False)
    secs = statistics.median(r.seconds for r in res.history)
    comm = statistics.median(r.comm.up_bytes + r.comm.down_bytes for r in res.history)
    return secs, float(comm)


def simulation_case(union: Path, alg: str, rounds: int, secagg: bool, out: Path) -> tuple[float, float]:
    from fedheads.flower.sim import simulate_store
    from fedheads.run.commands import FlowerRunConfig

    cfg = FlowerRunConfig(algorithm=alg, backbones="synth", rounds=rounds, eval_every=0, secagg=secagg, timeout=600)
    return per_round(simulate_store(cfg, str(union))["log"].rounds)


def loopback_case(stores: list[Path], alg: str, rounds: int, secagg: bool, out: Path) -> tuple[float, float]:
    from fedheads.flower.deploy import free_port

    port, procs = free_port(), []
    cli = [sys.executable, "-m", "fedheads.cli"]
    args = ["serve", "--nodes", str(len(stores)), "--port", str(port), "--algorithm", alg, "--backbones", "synth",
            "--rounds", str(rounds), "--eval-every", "0", "--timeout", "600", "--wait", "300", "--out", str(out)]
    try:
        procs.append(subprocess.Popen(cli + args + (["--secagg"] if secagg else []), start_new_session=True,
                                      stdout=subprocess.DEVNULL, stderr=open(out.parent / f"{out.name}.log", "wb")))
        for s in stores:
            procs.append(subprocess.Popen(cli + ["join", "--superlink", f"127.0.0.1:{port}", "--store", str(s)],
                                          start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if procs[0].wait(1800) != 0:
            raise RuntimeError(f"loopback run failed: {(out.parent / f'{out.name}.log').read_text()[-500:]}")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    return per_round(json.loads((out / "results.json").read_text())["flower"]["rounds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fedncm only, 2 rounds, 1 repeat")
    ap.add_argument("--algorithms", default="fedncm,fedpcl")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/flower[_quick].json)")
    a = ap.parse_args()
    # SIGTERM (e.g. `timeout`) as SystemExit: the loopback cases' `finally` then stops their SuperLink/SuperNodes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kinds = [k.strip() for k in a.cases.split(",") if k.strip()]
    if "engine" not in kinds or not set(kinds) <= set(CASES):
        ap.error(f"--cases {a.cases!r}: a subset of {', '.join(CASES)} that includes engine (the reference)")
    algs = ["fedncm"] if a.quick else a.algorithms.split(",")
    rounds, repeats = (2, 1) if a.quick else (a.rounds, a.repeats)
    result = {"machine": machine_facts(), "nodes": a.nodes, "rows_per_client": a.rows, "dim": a.dim,
              "classes": a.classes, "rounds": rounds, "repeats": repeats, "cases": []}
    path = Path(a.out) if a.out else HERE / "results" / ("flower_quick.json" if a.quick else "flower.json")
    with tempfile.TemporaryDirectory() as tmp:
        union, own = write_stores(Path(tmp), a.nodes, a.rows, a.dim, a.classes)
        for alg in algs:
            cases = [(k, s) for k in kinds for s in ((False,) if k == "engine" else (False, True))]
            for kind, secagg in cases:
                samples = []
                load0 = os.getloadavg()
                for rep in range(repeats):
                    out = Path(tmp) / f"{alg}-{kind}-{secagg}-{rep}"
                    if kind == "engine":
                        samples.append(engine_case(union, alg, rounds))
                    elif kind == "simulation":
                        samples.append(simulation_case(union, alg, rounds, secagg, out))
                    else:
                        samples.append(loopback_case(own, alg, rounds, secagg, out))
                secs = [s for s, _ in samples]
                rec = {"algorithm": alg, "case": kind, "secagg": secagg,
                       "seconds_per_round": {"median": statistics.median(secs), "min": min(secs), "max": max(secs)},
                       "bytes_per_round": statistics.median(b for _, b in samples),
                       "peak_rss_bytes": peak_rss(),  # this process (engine, simulation) and its children (loopback)
                       "loadavg_before": load0, "loadavg_after": os.getloadavg()}
                result["cases"].append(rec)
                print(f"{alg:8s} {kind:10s} secagg={secagg!s:5s} {rec['seconds_per_round']['median']:8.3f} s/round "
                      f"{rec['bytes_per_round']:12.0f} B/round", flush=True)
                write_json(result, path)  # after every case: a long run keeps what it measured
    eng = {c["algorithm"]: c["seconds_per_round"]["median"] for c in result["cases"] if c["case"] == "engine"}
    for c in result["cases"]:
        c["x_engine"] = c["seconds_per_round"]["median"] / max(eng[c["algorithm"]], 1e-9)
    write_json(result, path)
    print(f"-> {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
