"""Live fine-tuning (fedheads finetune) on Office-Caltech-10, feature shift, 10 training images
per class (FedPCL Table 8 split; 4 clients, one per domain), writes
benchmarks/results/finetune.json.

  speed     per backbone (resnet20-cifar10, resnet56-cifar10): seconds per fine-tuning round
            (training only: client updates + aggregation) for full live FT (`--trainable all`),
            cache-first `after:layer1` and `after:layer2` (the frozen prefix read from the store
            as activation maps, no live pass through it) and `head` (cached pooled features);
            the accuracy each reaches after the same rounds from the same FedNCM head; the bytes
            the cached maps take and the one-off seconds to extract them. Ratio = median round
            seconds of `all` / median round seconds of the mode (target: after:layer2 >= 10x).
  accuracy  FedNCM+FT vs LP+FT (5 LP rounds) vs FT (random head), full live FT of resnet20,
            accuracy per round over 3 seeds, and the first round at which each reaches FT's final
            accuracy (FedNCM paper, Figure 1 / Sec. 4.2: "FedNCM+FT converges rapidly").
  lite0     the same three methods with EfficientNet-Lite0 (ImageNet) at 160 px, cache-first
            `after:blocks.4` (on 2 CPU cores live 224 px FT of Lite0 runs ~4-7 img/s: a labelled
            deviation from full FT; the speed part measures what cache-first changes).

Timings are taken one configuration after another; run it on an otherwise idle machine
(`bash benchmarks/run_all.sh` does). Usage:
    python benchmarks/bench_finetune.py [--part speed,accuracy,lite0] [--rounds 10]
        [--speed-rounds 5] [--seeds 0,1,2] [--work DIR] [--quick]
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch
from assets import data_dir, display, weights_dir  # sibling module (benchmarks/ is on sys.path)
from machine_info import write_json  # sibling module

from fedheads.run.environment import machine

OUT = Path(__file__).resolve().parent / "results" / "finetune.json"


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _prepare(work: Path, quick: bool) -> tuple[Path, object]:
    from embedcache.manifest import save_manifest
    from embedcache.partitioning import Recipe, partition
    from embedcache.sources import open_source

    src = data_dir("office_caltech10")
    if not src.is_dir():
        raise SystemExit(f"needs Office-Caltech-10 at {src} (set EMBEDCACHE_ASSETS)")
    recipe = Recipe("feature-shift", train_per_class=10, test_per_class=10 if quick else None)
    m = partition(open_source(f"imagefolder:{src}"), recipe, seed=0)
    save_manifest(m, work / "manifest.json")
    return work / "manifest.json", m


def _extract(m: object, store: Path, names: list[str]) -> dict[str, float]:
    from embedcache.extraction import ExtractConfig, extract

    secs = {}
    for n in names:
        t = time.perf_counter()
        extract(m, ExtractConfig(backbones=(n,), store=str(store), weights_dir=str(weights_dir()), progress=False))
        secs[n] = time.perf_counter() - t
    return secs


def _round_seconds(run_dir: Path, seeds: tuple[int, ...]) -> list[float]:
    out = []
    for s in seeds:
        ck = torch.load(run_dir / "state" / f"seed{s}.ckpt.pt", weights_only=True)
        out += [r["train_seconds"] for r in ck["history"] if r["round"] > 0]
    return out


def _stats(v: list[float]) -> dict:
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return {"median": statistics.median(v), "q1": q[0], "q3": q[2], "min": min(v), "max": max(v), "n": len(v)}


def _run(man: Path, store: Path, backbone: str, out: Path, **kw) -> dict:
    from fedheads.finetuning.algorithm import FTConfig
    from fedheads.finetuning.runner import FinetuneOptions, finetune_run

    opts = FinetuneOptions(overwrite=True, progress=False, device="cpu", weights_dir=str(weights_dir()),
                           ft=FTConfig(), **kw)
    return finetune_run(man, str(store), backbone, out, opts)


def _train_flops(backbone: str, cuts: list[str]) -> dict:
    """Forward FLOPs per sample of the trained part (torch's FlopCounterMode) for `all` and each
    `after:CUT`, and their ratio: the compute-bound ceiling of the cache-first speed-up (a training
    step is ~3 forward passes of the trained part either way, FedNCM paper App. A; data loading and
    augmentation then add to the live side). Backward is not counted directly because
    FlopCounterMode over-counts the backward of grouped (depthwise) convolutions."""
    from torch.utils.flop_counter import FlopCounterMode

    from embedcache.backbones import create_backbone

    net = create_backbone(backbone, weights_dir=str(weights_dir()), device="cpu").trainable().eval()
    x = torch.randn(2, *net.input_size)

    @torch.no_grad()
    def forward(start: str | None) -> float:
        inp = x if start is None else net(x, stop=start)
        with FlopCounterMode(display=False) as fc:
            net(inp, start=start)
        return fc.get_total_flops() / x.shape[0]

    out = {"all": forward(None), **{f"after:{c}": forward(c) for c in cuts}}
    return {"per_sample_forward_flops": out,
            "compute_bound_speedup": {k: out["all"] / v for k, v in out.items() if k != "all"}}


def part_speed(man: Path, m: object, work: Path, rounds: int, quick: bool) -> dict:
    res = {}
    for bb in (["resnet20-cifar10"] if quick else ["resnet20-cifar10", "resnet56-cifar10"]):
        store = work / f"{bb}.zarr"
        cuts = ["layer1", "layer2"]
        ex = _extract(m, store, [bb] + [f"{bb}@{c}" for c in cuts])
        case: dict = {"flops": _train_flops(bb, cuts), "extract_seconds": ex,
                      "cached_bytes": {n: _du(store / n) for n in [bb] + [f"{bb}@{c}" for c in cuts]}}
        for mode in ["all", *(f"after:{c}" for c in cuts), "head"]:
            d = work / "runs" / bb / mode.replace(":", "_")
            r = _run(man, store, bb, d, heads=("fedncm",), rounds=rounds, eval_every=0, seeds=(0,), trainable=mode)
            secs = _round_seconds(d, (0,))
            case[mode] = {"round_seconds": secs, "stats": _stats(secs), "accuracy_after": r["accuracy"]["mean"],
                          "round0_accuracy": r["figure1"][0]["accuracy"]}
            click.echo(f"{bb} {mode}: {case[mode]['stats']['median']:.3f} s/round, acc {r['accuracy']['mean']:.1f}")
        base = case["all"]["stats"]["median"]
        case["speedup_vs_all"] = {mode: base / case[mode]["stats"]["median"]
                                  for mode in ("after:layer1", "after:layer2", "head")}
        res[bb] = case
    return res


def _curves(man: Path, store: Path, backbone: str, work: Path, rounds: int, seeds: tuple[int, ...],
            trainable: str) -> dict:
    d = work / "runs" / f"curves-{backbone.replace(':', '_')}"
    r = _run(man, store, backbone, d, heads=("fedncm", "lp", "random"), head_rounds=5, rounds=rounds,
             seeds=seeds, trainable=trainable)
    methods = {name: {"figure1": v["figure1"], "accuracy": v["accuracy"],
                      "seconds_per_round": v["stages"][1]["seconds_per_round"]} for name, v in r["algorithms"].items()}
    target = methods["ft"]["accuracy"]["mean"]
    for v in methods.values():
        v["first_round_reaching_ft_final"] = next((p["round"] for p in v["figure1"] if p["accuracy"] >= target), None)
    return {"trainable": trainable, "rounds": rounds, "seeds": list(seeds), "ft_final_accuracy": target,
            "methods": methods}


@click.command()
@click.option("--part", default="speed,accuracy,lite0", show_default=True)
@click.option("--rounds", default=10, show_default=True, help="Rounds of the accuracy curves.")
@click.option("--speed-rounds", default=5, show_default=True, help="Rounds timed per speed configuration.")
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--work", default=None, help="Keep stores and runs here (default: a temp dir, removed).")
@click.option("--quick", is_flag=True, help="10 test images per class, resnet20 only, 2 rounds, 1 seed.")
@click.option("--out", "out_path", default=str(OUT), show_default=True)
def main(part: str, rounds: int, speed_rounds: int, seeds: str, work: str | None, quick: bool, out_path: str) -> None:
    parts = [p.strip() for p in part.split(",") if p.strip()]
    seed_t = (0,) if quick else tuple(int(s) for s in seeds.split(","))
    if quick:
        rounds, speed_rounds = 2, 2
    tmp = Path(work) if work else Path(tempfile.mkdtemp(prefix="bench_ft_"))
    tmp.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine("cpu"), "load_average_at_start": os.getloadavg(),
                     "data": display(data_dir("office_caltech10")), "setting": "feature shift, 10 train/class, 4 clients",
                     "quick": quick}
    try:
        man, m = _prepare(tmp, quick)
        if "speed" in parts:
            results["speed"] = part_speed(man, m, tmp, speed_rounds, quick)
        if "accuracy" in parts:
            store = tmp / "resnet20-cifar10.zarr"
            _extract(m, store, ["resnet20-cifar10"])
            results["accuracy"] = _curves(man, store, "resnet20-cifar10", tmp, rounds, seed_t, "all")
        if "lite0" in parts and not quick:
            bb = "efficientnet-lite0:160"
            store = tmp / "lite0.zarr"
            ex = _extract(m, store, [bb, f"{bb}@blocks.4"])
            results["lite0"] = {"flops": _train_flops(bb, ["blocks.4"]), "extract_seconds": ex,
                                **_curves(man, store, bb, tmp, rounds, seed_t, "after:blocks.4")}
    finally:
        results["load_average_at_end"] = os.getloadavg()
        if not work:
            shutil.rmtree(tmp, ignore_errors=True)
    target = Path(out_path)
    write_json(results, target)
    click.echo(f"wrote {target}")


if __name__ == "__main__":
    main()
