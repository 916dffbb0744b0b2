"""Parameter-efficient fine-tuning, cache-first: seconds per round and peak memory of LoRA with the
prefix read from the store, the same LoRA with the prefix run live, and fine-tuning the same stages
whole from the store; writes benchmarks/results/peft.json.

Data: Office-Caltech-10, feature shift, 10 training images per class (4 clients, 400 training
images per round: bench_finetune's split), EfficientNet-Lite0 (ImageNet, 224 px). The cut is
after blocks.5: the adapters sit on blocks.6's conv_pw / conv_pwl and conv_head (the family
default), FT trains blocks.6 and the features stage whole.

    lora-cache   --set adapter=lora --set trainable=after:blocks.5 (maps after blocks.5 from the store)
    lora-live    the same with --set live_prefix=true (images decoded, prefix run live, no grad)
    ft-cache     --set trainable=after:blocks.5 (the stages trained whole, maps from the store)

Each configuration runs in a fresh process (peak RSS = that process's VmHWM); the round
seconds are the training time of rounds 1..R (client updates + aggregation; evaluation excluded),
reported as median and quartiles over the rounds. The FLOP ceiling of what the cut saves: a LoRA
round costs the suffix's forward plus its backward to the adapters (about 2 forward passes of the
suffix: input gradients, the frozen weights get none) cache-first, plus one forward of the prefix
live; FlopCounterMode counts the forwards (bench_finetune._train_flops).

Usage: python benchmarks/bench_peft.py [--rounds 4] [--live-rounds 3] [--work DIR] [--quick]
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click
from bench_finetune import _du, _extract, _prepare, _round_seconds, _run, _stats, _train_flops
from machine_info import write_json

from fedheads.run.environment import machine

OUT = Path(__file__).resolve().parent / "results" / "peft.json"
BACKBONE, CUT = "efficientnet-lite0", "blocks.5"
CONFIGS = {
    "lora-cache": {"adapter": "lora", "live_prefix": False},
    "lora-live": {"adapter": "lora", "live_prefix": True},
    "ft-cache": {"adapter": "none", "live_prefix": False},
}


def _one(name: str, man: Path, store: Path, out: Path, rounds: int) -> dict:
    """One configuration in this (fresh) process: its round seconds, accuracy and peak RSS."""
    from fedheads.finetuning.adapters.base import AdapterConfig

    cfg = CONFIGS[name]
    r = _run(man, store, BACKBONE, out, heads=("fedncm",), rounds=rounds, eval_every=0, seeds=(0,),
             trainable=f"after:{CUT}", live_prefix=cfg["live_prefix"], adapter=cfg["adapter"], lora=AdapterConfig(),
             augment=False, num_workers=0)
    secs = _round_seconds(out, (0,))
    comm = r["communication"]
    return {"round_seconds": secs, "stats": _stats(secs), "accuracy_after": r["accuracy"]["mean"],
            "trainable_params_per_client": r.get("trainable_params_per_client"),
            "upload_values_per_client_per_round": comm.get("upload_params_per_client_per_round"),
            "peak_rss_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    """This process's resident high-water mark (VmHWM: reset by exec, unlike ru_maxrss, which keeps
    the parent's peak at fork time; the parent here extracted features)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@click.command()
@click.option("--rounds", default=4, show_default=True, help="Rounds timed per cache-first configuration.")
@click.option("--live-rounds", default=3, show_default=True, help="Rounds timed for live LoRA.")
@click.option("--work", default=None, help="Keep the store and runs here (default: a temp dir, removed).")
@click.option("--quick", is_flag=True, help="10 test images per class, 2 rounds each.")
@click.option("--out", "out_path", default=str(OUT), show_default=True)
@click.option("--one", default=None, hidden=True, help="Internal: run one configuration, print its JSON.")
def main(rounds: int, live_rounds: int, work: str | None, quick: bool, out_path: str, one: str | None) -> None:
    tmp = Path(work) if work else Path(tempfile.mkdtemp(prefix="bench_peft_"))
    tmp.mkdir(parents=True, exist_ok=True)
    man, store = tmp / "manifest.json", tmp / "store.zarr"
    if one is not None:
        n = rounds if one != "lora-live" else live_rounds
        print("RESULT " + json.dumps(_one(one, man, store, tmp / "runs" / one, n)), flush=True)
        return
    try:
        _, m = _prepare(tmp, quick)
        ex = _extract(m, store, [BACKBONE, f"{BACKBONE}@{CUT}"])
        if quick:
            rounds = live_rounds = 2
        res: dict = {"load_average_at_start": os.getloadavg(), "backbone": BACKBONE, "cut": CUT, "extract_seconds": ex,
                     "cached_bytes": {n: _du(store / n) for n in (BACKBONE, f"{BACKBONE}@{CUT}")},
                     "flops": _train_flops(BACKBONE, [CUT]), "configs": {}}
        for name in CONFIGS:
            cmd = [sys.executable, __file__, "--one", name, "--work", str(tmp), "--rounds", str(rounds),
                   "--live-rounds", str(live_rounds)]
            p = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
            res["configs"][name] = json.loads(line[len("RESULT "):])
            st = res["configs"][name]["stats"]
            click.echo(f"{name}: {st['median']:.2f} s/round (q1 {st['q1']:.2f}, q3 {st['q3']:.2f}), "
                       f"peak {res['configs'][name]['peak_rss_mb']:.0f} MB, acc {res['configs'][name]['accuracy_after']:.1f}")
        c = res["configs"]
        fwd = res["flops"]["per_sample_forward_flops"]
        suffix, whole = fwd[f"after:{CUT}"], fwd["all"]
        res["cache_first_speedup"] = {
            "lora_live_over_lora_cache": c["lora-live"]["stats"]["median"] / c["lora-cache"]["stats"]["median"],
            "ft_cache_over_lora_cache": c["ft-cache"]["stats"]["median"] / c["lora-cache"]["stats"]["median"],
            # compute-bound ceiling: live = prefix forward + ~2 suffix passes; cache-first = ~2 suffix passes
            "flop_ceiling_lora": (whole - suffix + 2 * suffix) / (2 * suffix),
        }
        res["machine"] = machine("cpu")
        res["load_average_at_end"] = os.getloadavg()
        res["rounds"], res["live_rounds"], res["quick"] = rounds, live_rounds, quick
        write_json(res, out_path)
        click.echo(json.dumps(res["cache_first_speedup"], indent=1))
    finally:
        if not work:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
