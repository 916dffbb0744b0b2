"""Cached features vs a live backbone pass: FedPCL on Office-Caltech-10 feature shift.

(a) cached: `embedcache extract` (cold, into a fresh store) + `fedheads train --algorithm fedpcl`
    on the cache, each timed as a separate command (process start-up included), plus the same
    training in process through the Python API (`fedheads.train`, which runs what the command
    runs: its loading, layout and client order) for the per-round time (results' "timing").
    The two are one run: "accuracy_command" equals "accuracy_final", and
    "states_equal_to_command" says whether the final states are the command's bit for bit. They
    must be: a single seed's FedPCL accuracy after many rounds moves by points with float
    rounding alone, e.g. with the order the engine stacks the clients in (largest first, so the
    order its sums over clients take), so a run stacked differently is not the same run.
(b) live: benchmarks/live_fedpcl.py, the FedPCL authors' loop (every round, every client
    re-decodes its images and runs every frozen backbone on every training batch, again for the
    prototypes, again over its test set), on the same head, loss, optimiser and batch size.
    When fewer live rounds are run than cached ones, the live total is extrapolated from the
    measured rounds and the JSON says so ("live_rounds_measured", "extrapolated": true).

Accuracies are comparable but not bitwise equal: the live run shuffles its batches like a
DataLoader, the engine uses its own seeded schedule (and batched conv kernels can differ in the
last float bits).

    python benchmarks/bench_cached_vs_live.py [--rounds 100] [--live-rounds 5]
        [--out benchmarks/results/cached_vs_live.json]
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as a plain script from a checkout
    sys.path.insert(0, str(REPO))
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))

import assets  # noqa: E402  (sibling modules: benchmarks/ is on sys.path)
from live_fedpcl import LiveConfig, LiveResult, run_live  # noqa: E402
from machine_info import cpu_model, write_json  # noqa: E402

from embedcache.errors import UserError  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "cached_vs_live.json"
BACKBONES = ("resnet20-cifar10", "resnet56-cifar10")


def _log(msg: str) -> None:
    click.echo(f"[bench {time.strftime('%H:%M:%S')}] {msg}", err=True)


def _tool(name: str) -> list[str]:
    """The `embedcache` / `fedheads` command, run by this interpreter (the venv's packages)."""
    return [sys.executable, "-m", f"{name}.cli"]


def timed_command(argv: Sequence[str], env: dict[str, str] | None = None) -> float:
    """Run a command to completion (its progress goes to our stderr); wall seconds."""
    t = time.perf_counter()
    proc = subprocess.run(list(argv), env={**os.environ, **(env or {})}, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=None, text=True)
    secs = time.perf_counter() - t
    if proc.returncode != 0:
        raise UserError(f"{' '.join(argv[2:5])}: exited with {proc.returncode}: {proc.stdout.strip()[-300:]}")
    return secs


def partition(source: str, manifest: Path, train_per_class: int, seed: int,
              env: dict[str, str] | None = None) -> float:
    """`embedcache partition SOURCE --scheme feature-shift ...` -> seconds."""
    return timed_command(_tool("embedcache") + ["partition", source, "--scheme", "feature-shift",
                                                "--train-per-class", str(train_per_class),
                                                "--seed", str(seed), "--out", str(manifest)], env)


def cached_phase(manifest: Path, backbones: Sequence[str], work: Path, rounds: int, seed: int,
                 weights_dir: str | None, plugins: Sequence[str] = (), env: dict[str, str] | None = None,
                 settings: Sequence[str] = ()) -> dict[str, Any]:
    """Cold extract + `fedheads train` (timed separately), then the same training in process
    (`fedheads.train`) for per-round timing, checked against the command's saved states.
    Returns the "cached" JSON section."""
    store, run_dir = work / "store", work / "run"
    shutil.rmtree(store, ignore_errors=True)  # cold: a fresh store, nothing to hit
    argv = _tool("embedcache") + ["extract", "--manifest", str(manifest), "--backbones", ",".join(backbones),
                                  "--store", str(store), "--device", "cpu"]
    argv += ["--weights-dir", weights_dir] if weights_dir else []
    for p in plugins:
        argv += ["--plugin", p]
    _log(f"extract (cold) {','.join(backbones)} -> {store}")
    extract_s = timed_command(argv, env)
    _log(f"extract: {extract_s:.1f}s; fedheads train fedpcl {rounds} rounds")
    argv = _tool("fedheads") + ["train", "--store", str(store), "--backbones", ",".join(backbones),
                                "--algorithm", "fedpcl", "--rounds", str(rounds), "--seeds", str(seed),
                                "--device", "cpu", "--quiet", "--overwrite",  # ours: a --work re-run replaces it
                                "--out", str(run_dir)]
    for s in settings:
        argv += ["--set", s]
    train_cmd_s = timed_command(argv, env)
    results = json.loads((run_dir / "results.json").read_text())
    _log(f"fedheads train: {train_cmd_s:.1f}s, accuracy {results.get('accuracy_cell')}")

    # The same run in process, through the Python API: exactly what the command trains (its
    # loading, layout and client order), without process start-up, imports or run-directory
    # writing, for the per-round time. Its final states must be the command's bit for bit.
    import fedheads
    from fedheads.run.settings import parse_settings

    res = fedheads.train(str(store), "fedpcl", backbones=list(backbones), rounds=rounds, seeds=seed, device="cpu",
                         settings=dict(parse_settings(settings)))
    timing = res.timing["per_seed"][0]
    train_s = timing["rounds"]["train_wall_seconds"]  # per round, training + aggregation (no evaluation)
    steady = train_s[1:] or train_s[:1]
    same = same_states(run_dir / "state" / f"seed{seed}.pt", res.states[seed])
    if not same:
        _log("WARNING: the in-process run's final states differ from the command's: not the same run")
    return {
        "extract_seconds": extract_s,
        "train_command_seconds": train_cmd_s,
        "total_seconds": extract_s + train_cmd_s,
        "engine_wall_seconds": timing["wall_seconds"],
        "round_seconds": timing["wall_seconds"] / rounds,  # train + aggregate + evaluation, per round
        "round_train_seconds_median": statistics.median(steady),  # train + aggregate only (rounds >= 2)
        "accuracy_command": results["accuracy"]["mean"],
        "accuracy_final": res.accuracy["mean"],
        "states_equal_to_command": same,
        "per_client_final": {n: v["mean"] for n, v in res.per_client.items()},
        "history": [{"round": h["round"], "accuracy": h["accuracy"]} for h in res.history],
        "clients": list(res.clients),
        "n_train": split_sizes(store, backbones[0], res.clients, "train"),
        "n_test": split_sizes(store, backbones[0], res.clients, "test"),
        "feature_dim": res.feature_dim,
        "store_bytes": sum(f.stat().st_size for f in store.rglob("*") if f.is_file()),
    }


def same_states(saved: Path, state: Any) -> bool:
    """Whether a run's final states (an engine RunResult) are, leaf for leaf and bit for bit,
    those a `fedheads train` run directory saved (its state/seed<S>.pt)."""
    from fedheads.core.tree import tree_leaves
    from fedheads.run.checkpoint import load_sealed
    from fedheads.run.saved import STATE_FORMAT

    blob = load_sealed(saved, STATE_FORMAT, "train the run again")
    ours = {"client": tree_leaves(state.client_state), "server": tree_leaves(state.server_state)}
    return all(len(blob[k]) == len(v) and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.cpu())
                                              for a, b in zip(blob[k], v)) for k, v in ours.items())


def split_sizes(store: Path, backbone: str, clients: Sequence[str], split: str) -> list[int]:
    """Rows of each client's `split` in the store (0 where it has none)."""
    from embedcache.store.reader import open_store

    info = open_store(store)
    return [0 if (sh := info.shard(backbone, c, split)) is None else int(sh.n) for c in clients]


def live_phase(manifest: Any, source: Any, backbones: Sequence[Any], rounds: int, live_rounds: int, seed: int,
               setup_s: float, cfg: LiveConfig | None = None) -> tuple[dict[str, Any], LiveResult]:
    """Run `live_rounds` live rounds; extrapolate to `rounds` from the measured training rounds."""
    n = min(live_rounds, rounds)
    base = cfg or LiveConfig()
    cfg = LiveConfig(rounds=n, seed=seed, num_workers=base.num_workers, eval_batch_size=base.eval_batch_size,
                     batch_order=base.batch_order, fedpcl=base.fedpcl, progress=base.progress)
    res = run_live(manifest, source, backbones, cfg)
    recs = res.rounds
    train_rounds = recs[1:] or recs  # round 0 only collects prototypes (no training pass)
    mean = lambda key: statistics.fmean(getattr(r, key) for r in train_rounds)  # noqa: E731
    round_s = mean("total_s")
    measured = sum(r.total_s for r in recs)
    extrapolated = n < rounds
    total_rounds_s = measured + (rounds - n) * round_s if extrapolated else measured
    out = {
        "live_rounds_measured": n,
        "extrapolated": extrapolated,
        "setup_seconds": setup_s,  # backbone creation, manifest/source opening
        "measured_seconds": measured,
        "total_seconds": setup_s + total_rounds_s,
        "round_seconds": round_s,  # mean over measured training rounds (round >= 2)
        "round_breakdown_seconds": {k: mean(k + "_s") for k in ("train", "proto", "eval", "aggregate")},
        "round0_seconds": recs[0].total_s,
        "images_decoded_per_round": train_rounds[-1].images_decoded,
        "accuracy_final": 100.0 * statistics.fmean(a for a in res.final_accuracy() if a == a),
        "per_client_final": {c: 100.0 * a for c, a in zip(res.clients, res.final_accuracy())},
        "history": [{"round": r.round + 1, "accuracy": 100.0 * statistics.fmean(a for a in r.accuracy if a == a),
                     "seconds": r.total_s} for r in recs],
        "num_workers": cfg.num_workers,
        "batch_order": cfg.batch_order,
    }
    return out, res


def summarise(cached: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """Ratios and the accuracy comparison at equal round counts."""
    n = live["live_rounds_measured"]
    at_n = next((h["accuracy"] for h in cached["history"] if h["round"] == n), None)
    return {
        "end_to_end_ratio": live["total_seconds"] / cached["total_seconds"],
        "per_round_ratio": live["round_seconds"] / cached["round_seconds"],
        "per_round_train_ratio": (live["round_breakdown_seconds"]["train"] + live["round_breakdown_seconds"]["proto"]
                                  + live["round_breakdown_seconds"]["aggregate"]) / cached["round_train_seconds_median"],
        "targets": {"end_to_end_ratio": 15.0, "per_round_ratio": 100.0},
        "definitions": {
            "end_to_end_ratio": "live.total_seconds (setup + all rounds, extrapolated when live_rounds_measured < "
                                "rounds) / cached.total_seconds (cold `embedcache extract` + `fedheads train` commands)",
            "per_round_ratio": "live.round_seconds (train + prototypes + test evaluation + aggregation, mean over "
                               "measured rounds >= 2) / cached.round_seconds (engine wall time incl. per-round "
                               "evaluation / rounds)",
            "per_round_train_ratio": "the same without test evaluation: live train + prototypes + aggregation / "
                                     "cached median round time without evaluation (rounds >= 2)",
            "round 1": "collects prototypes only (no training), in both runs"},
        "accuracy": {"cached_final": cached["accuracy_final"], "cached_at_live_rounds": at_n,
                     "live_at_live_rounds": live["accuracy_final"], "rounds_compared": n,
                     "cached_note": "cached_final is the `fedheads train` command's run, also trained in process "
                                    "through fedheads.train for the per-round time (cached.accuracy_command = "
                                    "cached.accuracy_final; cached.states_equal_to_command: the final states bit "
                                    "for bit)",
                     "note": "live vs cached, not bitwise equal: the live run shuffles batches DataLoader-style, the engine "
                             "uses its own seeded schedule; features come from differently sized conv batches"},
    }


def environment(threads: int) -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "torch": torch.__version__,
            "torch_threads": threads, "python": platform.python_version(), "device": "cpu",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "load_average_1_5_15": list(os.getloadavg())}


@click.command()
@click.option("--rounds", default=100, show_default=True, help="Communication rounds (cached run; live extrapolated).")
@click.option("--live-rounds", default=5, show_default=True, help="Live rounds actually run.")
@click.option("--seed", default=0, show_default=True)
@click.option("--train-per-class", default=10, show_default=True, help="Training images per class per domain.")
@click.option("--source", default=None,
              help="Image source spec for `embedcache partition` (default: imagefolder:<assets>/data/office_caltech10, "
                   "<assets> = $EMBEDCACHE_ASSETS or ../shared).")
@click.option("--backbones", default=",".join(BACKBONES), show_default=True)
@click.option("--weights-dir", default=None, help="Default: as the CLIs resolve it (benchmarks/assets.py).")
@click.option("--num-workers", default=2, show_default=True, help="Live DataLoader workers per loader.")
@click.option("--threads", default=None, type=int,
              help="torch intra-op threads for every phase (OMP_NUM_THREADS for the commands); default: torch's.")
@click.option("--work", default=None, help="Scratch directory (default: a fresh temporary one, removed after).")
@click.option("--out", default=str(OUT), show_default=True)
def main(rounds: int, live_rounds: int, seed: int, train_per_class: int, source: str | None, backbones: str,
         weights_dir: str | None, num_workers: int, threads: int | None, work: str | None, out: str) -> None:
    """Time FedPCL on cached features against the authors' live-backbone loop."""
    env: dict[str, str] = {}
    if threads:  # the same setting for the commands (cached) and this process (live)
        torch.set_num_threads(threads)
        env["OMP_NUM_THREADS"] = str(threads)
    names = tuple(b.strip() for b in backbones.split(",") if b.strip())
    weights_dir = str(assets.weights_dir(weights_dir))
    if source is None:
        root = assets.data_dir("office_caltech10")
        if not root.is_dir():
            raise UserError(f"{root}: Office-Caltech-10 not found (set EMBEDCACHE_ASSETS or pass --source)")
        source = f"imagefolder:{root}"
    tmp = Path(work) if work else Path(tempfile.mkdtemp(prefix="bench-cached-live-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        manifest_path = tmp / "manifest.json"
        _log(f"partition {source} (feature shift, {train_per_class}/class, seed {seed})")
        part_s = partition(source, manifest_path, train_per_class, seed, env)
        cached = cached_phase(manifest_path, names, tmp, rounds, seed, weights_dir, env=env)
        cached["partition_seconds"] = part_s
        _log(f"cached: {cached['round_seconds'] * 1e3:.1f} ms/round, final accuracy {cached['accuracy_final']:.2f}%")

        from embedcache.backbones import create_backbone
        from embedcache.manifest import load_manifest
        from embedcache.sources import open_source

        t = time.perf_counter()
        manifest = load_manifest(manifest_path)
        src = open_source(manifest.source)
        bbs = [create_backbone(n, weights_dir=weights_dir, device="cpu") for n in names]
        setup_s = time.perf_counter() - t
        _log(f"live: {live_rounds} of {rounds} rounds, {num_workers} DataLoader workers")
        live, _ = live_phase(manifest, src, bbs, rounds, live_rounds, seed, setup_s,
                             LiveConfig(num_workers=num_workers))
        _log(f"live: {live['round_seconds']:.2f} s/round, accuracy after {live['live_rounds_measured']} rounds "
             f"{live['accuracy_final']:.2f}%")
    finally:
        if not work:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "command": " ".join(["python", "benchmarks/bench_cached_vs_live.py"] + sys.argv[1:]),
        "benchmark": "FedPCL cached features vs live frozen backbones (authors' per-round loop)",
        "data": {"source": assets.display_source(source), "scheme": "feature-shift", "train_per_class": train_per_class,
                 "seed": seed, "clients": cached["clients"], "n_train": cached["n_train"], "n_test": cached["n_test"]},
        "backbones": list(names), "feature_dim": cached["feature_dim"], "rounds": rounds,
        "algorithm": {"name": "fedpcl", "variant": "paper", "batch_size": 32, "local_epochs": 1,
                      "optimizer": "adam lr 1e-3 wd 1e-4"},
        "environment": environment(torch.get_num_threads()),
        "live_rounds_measured": live["live_rounds_measured"], "extrapolated": live["extrapolated"],
        "cached": cached, "live": live, **summarise(cached, live),
    }
    write_json(result, Path(out))
    _log(f"end-to-end ratio {result['end_to_end_ratio']:.1f}x, per-round ratio {result['per_round_ratio']:.0f}x -> {out}")


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
