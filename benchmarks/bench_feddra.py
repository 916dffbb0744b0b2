"""FedDRA on the offline setting (FedDRA notes section 3: Office-Caltech-10 amazon + caltech10 with
derived captions, 5 label-shift clients, data_manifests/office10-feddra-5clients-seed0.json),
resnet20-cifar10 image tokens after layer3 (64 tokens x 64 ch) and minilm-l6-v2:32 text tokens
after layer.5 (32 x 384); writes benchmarks/results/feddra.json.

  speed    seconds per local step (one FedDRA.client_update of E steps, divided by E), client 0:
           stage 1 from the store's token states vs the SAME step with live frozen encoder passes
           (images decoded and transformed, ResNet-20 to layer3 and MiniLM to layer.5, run once and
           read by the trained model and by the anchor of L_C, as the live path runs them; also the
           older path that ran them again for the anchor); timed alternately in one process, the
           ratio is of their medians (target >= 20x on this CPU); the FLOPs of each step
           (torch FlopCounterMode: the compute-bound ceiling of the ratio); stage 2 as the quick
           preset runs it (image encoder trained, text frozen) and as the paper does (both trained).
  speed-paper-sized  the stage-1 comparison with encoders of the paper's sizes (ResNet-50 at 224
           px, a BERT-base-sized text encoder at 128 tokens), random weights and inputs.
  methods  FedDRA vs FedAvg vs FedAvg with FedDRA's two-stage schedule vs the three Table 3
           ablations (no-two-stage, no-constraint, no-dro) at `fedheads feddra --preset quick`,
           seeds 0,1,2 (FedAvg = `fedavg`, the paper's one-stage FedAvg, which every method is
           paired with; `fedavg-two-stage` is mu = rho = 0 with FedDRA's schedule, the `fedavg` of
           results recorded before 2026-11-27, run beside it so that the schedule's share of
           FedDRA's lead shows): text->image R@1/R@5 mean over
           clients and worst client (percent, {mean, std} over seeds), chance and the class-only
           retriever, final lambda, wall minutes; with --probe also the few-shot linear probe on
           webcam + dslr (1 and 5 shots per class, 5 draws) of the aligned z, the trained image
           encoder's pooled output and the pre-trained backbone's (fedheads/alignment/probe.py).

Usage: python benchmarks/bench_feddra.py [--part speed,speed-paper-sized,methods] [--repeats 7] [--seeds 0,1,2]
           [--methods feddra,fedavg,...] [--mu MU] [--rounds R] [--steps-per-stage E] [--probe] [--store STORE]
           [--work DIR] [--quick] [--out FILE]
--quick: 3 repeats, seed 0, methods 1 round x 2 steps: checks the script, not figures. Without --store the token
states are extracted into --work first (seconds recorded). Run on an otherwise idle machine.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import click
import torch
from assets import REPO, data_dir, weights_dir  # sibling module (benchmarks/ is on sys.path)
from machine_info import machine_facts, write_json

OUT = Path(__file__).resolve().parent / "results" / "feddra.json"
MANIFEST = REPO / "data_manifests" / "office10-feddra-5clients-seed0.json"
PROBE = REPO / "data_manifests" / "office10-feddra-probe-5shot-seed0.json"  # webcam + dslr, 5 per class labelled
IMAGE, CUT, TEXT, TCUT = "resnet20-cifar10", "layer3", "minilm-l6-v2:32", "layer.5"
METHODS = ("feddra", "fedavg", "fedavg-two-stage", "no-two-stage", "no-constraint", "no-dro")


def _per_seed(run_dir: Path) -> dict[int, dict[str, float]]:
    """text->image R@1 (percent) of each seed at the last round, from the run's metrics.csv:
    the mean over clients and the worst client, as results.json's `mean` / `worst` per seed."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    last = max(int(r["round"]) for r in rows)
    by: dict[int, list[float]] = {}
    for r in rows:
        if int(r["round"]) == last:
            by.setdefault(int(r["seed"]), []).append(float(r["t2i_r1"]))
    return {s: {"mean": statistics.fmean(v), "worst": min(v)} for s, v in sorted(by.items())}


def _paired(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> dict:
    """a - b on the seeds both ran (same seed = same data order and initialisation): mean and
    std of the differences, wins / losses / ties, and the exact two-sided sign test."""
    seeds = sorted(set(a) & set(b))
    out: dict = {"seeds": seeds}
    for k in ("mean", "worst"):
        d = [a[s][k] - b[s][k] for s in seeds]
        wins, losses = sum(x > 0 for x in d), sum(x < 0 for x in d)
        n = wins + losses
        tail = sum(math.comb(n, i) for i in range(max(wins, losses), n + 1)) / 2 ** n if n else 0.5
        out[k] = {"diff_mean": statistics.fmean(d) if d else None, "diff_std": statistics.stdev(d) if len(d) > 1 else None,
                  "wins": wins, "losses": losses, "ties": len(d) - n, "sign_test_p": min(1.0, 2 * tail)}
    return out


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "all": xs}


def _store(work: Path, store: str | None) -> tuple[str, dict]:
    if store:
        return store, {}
    from embedcache.extraction import ExtractConfig, extract
    from embedcache.manifest import load_manifest

    out, secs = work / "store.zarr", {}
    for name in (f"{IMAGE}@{CUT}", f"{TEXT}@{TCUT}"):
        t = time.perf_counter()
        extract(load_manifest(MANIFEST), ExtractConfig(backbones=(name,), store=str(out),
                                                       weights_dir=str(weights_dir()), progress=False))
        secs[name] = time.perf_counter() - t
    return str(out), secs


def _opts(**kw):
    from fedheads.alignment.algorithm import FedDRAConfig
    from fedheads.alignment.runner import PRESETS, FedDRAOptions

    q = PRESETS["quick"]
    fd = FedDRAConfig(rounds=q["rounds"], steps=q["steps"], batch_size=q["batch_size"])
    base = dict(fd=fd, image_cut=CUT, text_cut=TCUT, text_trainable=q["text_trainable"], device="cpu",
                weights_dir=str(weights_dir()), progress=False)
    base.update(kw)
    return FedDRAOptions(**base)


def _per_step(call, n: int, flops: bool = False) -> float:
    """`call()` runs n steps: seconds per step, or (`flops`) FLOPs per step by torch's
    FlopCounterMode (matmuls, convolutions and attention, forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    if flops:
        with FlopCounterMode(display=False) as fc:
            call()
        return fc.get_total_flops() / n
    t = time.perf_counter()
    call()
    return (time.perf_counter() - t) / n


def _step_seconds(su, opts, stage: int, cached: bool, steps: int, shared: bool = True, flops: bool = False) -> float:
    """One client_update of `steps` steps on client 0, seconds (or FLOPs) per step (_per_step).
    `shared`: live stage 1 encodes a batch once for the model and the anchor (the product's path)."""
    from fedheads.alignment.algorithm import FedDRA
    from fedheads.alignment.pairs import step_rows
    from fedheads.alignment.runner import _build

    alg = FedDRA(opts.fd)
    alg.share_frozen_pass = shared
    net = _build(su, opts, 0, su.device)
    glob = copy.deepcopy(net).eval()
    ss = alg.init(net, len(su.clients))
    c = su.clients[0]
    rows = step_rows(c.n_train, c.index, opts.fd.batch_size, steps, 0, 0, stage)
    cache = c.train.base if cached else None
    txt = c.train.base if (cached or stage == 2) and not net.text_stages else None
    # batches are made lazily: reading the cache or the images is part of a step
    batches = c.batches("train", rows, su.device, img=cache, txt=txt, augment=(0, stage) if stage == 2 else None)
    return _per_step(lambda: alg.client_update(stage, ss.model, batches, 1.0, c.index, net, glob), steps, flops)


def part_speed(store: str, repeats: int, steps: int) -> dict:
    from fedheads.alignment.runner import _setup, apply_baseline

    opts = _opts()
    su = _setup(str(MANIFEST), store, IMAGE, TEXT, opts, [apply_baseline(opts.fd, "feddra")])
    paper = _opts(text_trainable="all")
    su_paper = _setup(str(MANIFEST), store, IMAGE, TEXT, paper, [apply_baseline(paper.fd, "feddra")])
    runs: dict[str, list[float]] = {"stage1_cache": [], "stage1_live": [], "stage1_live_two_passes": [],
                                    "stage2_quick": [], "stage2_paper": []}
    flops = {"stage1_cache": _step_seconds(su, opts, 1, True, 2, flops=True),
             "stage1_live": _step_seconds(su, opts, 1, False, 2, flops=True),
             "stage1_live_two_passes": _step_seconds(su, opts, 1, False, 2, shared=False, flops=True)}
    _step_seconds(su, opts, 1, True, 2)  # warm-up (allocator, kernels, page cache)
    _step_seconds(su, opts, 1, False, 2)
    for _ in range(repeats):  # alternate, so a change of machine load hits every side alike
        runs["stage1_cache"].append(_step_seconds(su, opts, 1, True, steps))
        runs["stage1_live"].append(_step_seconds(su, opts, 1, False, steps))
        runs["stage1_live_two_passes"].append(_step_seconds(su, opts, 1, False, steps, shared=False))
    for _ in range(max(1, repeats // 2)):
        runs["stage2_quick"].append(_step_seconds(su, opts, 2, False, max(2, steps // 2)))
        runs["stage2_paper"].append(_step_seconds(su_paper, paper, 2, False, 2))
    out = {k: _stats(v) for k, v in runs.items()}
    out["stage1_live_over_cache"] = out["stage1_live"]["median"] / out["stage1_cache"]["median"]
    out["stage1_live_two_passes_over_cache"] = out["stage1_live_two_passes"]["median"] / out["stage1_cache"]["median"]
    # the compute-bound ceiling of the cache's speed-up: what a step must compute either way
    out["flops_per_step"] = {k: round(v) for k, v in flops.items()}
    out["stage1_flop_ceiling"] = flops["stage1_live"] / flops["stage1_cache"]
    out["stage1_cache_gflops_per_second"] = flops["stage1_cache"] / out["stage1_cache"]["median"] / 1e9
    out["setting"] = {"batch_size": opts.fd.batch_size, "steps_per_timing": steps, "client": su.clients[0].name,
                      "image_tokens": f"{IMAGE}@{CUT}", "text_tokens": f"{TEXT}@{TCUT}", "mu": opts.fd.mu}
    return out


def part_speed_paper_sized(repeats: int, steps: int, batch: int = 32) -> dict:
    """Stage 1 cache vs live with encoders of the paper's sizes (FedDRA Sec. 5.1.3: ResNet-50 at
    224 px, tokens after layer4 = 49 x 2048; a BERT-base-sized text encoder, 12 layers x 768, at
    128 tokens, tokens after layer.11), random weights (seconds and FLOPs do not depend on them)
    and random inputs, so the live side leaves out decoding and tokenising (it is, if anything,
    under-counted). Same FedDRA step, modules, optimizer, batch and mu as `speed`."""
    import timm

    from embedcache.backbones.bert import BertConfig, build_bert
    from embedcache.backbones.staged import staged_from_module
    from fedheads.alignment.algorithm import FedDRA
    from fedheads.alignment.model import DualEncoder
    from fedheads.alignment.pairs import PairBatch

    torch.manual_seed(0)
    image = staged_from_module("resnet50", timm.create_model("resnet50", pretrained=False, num_classes=0),
                               input_size=(3, 224, 224))
    T = 128
    text = build_bert("bert-base-sized", BertConfig(30522, 768, 12, 12, 3072, 512, 2, 1e-12), T)
    net = DualEncoder(image, "layer4", text, 768, image_trainable="frozen", text_trainable="frozen",
                      text_cut="layer.11")
    glob = copy.deepcopy(net).eval()
    fd = _opts().fd
    alg = FedDRA(fd)
    ss = alg.init(net, 1)
    g = torch.Generator().manual_seed(0)
    live = [PairBatch(images=torch.randn(batch, 3, 224, 224, generator=g),
                      ids=torch.randint(1000, 30000, (batch, T), generator=g),
                      mask=torch.ones(batch, T, dtype=torch.bool)) for _ in range(steps)]
    with torch.no_grad():  # the cache holds exactly these token states
        cached = [alg.frozen_tokens(net, b) for b in live]

    def one(batches, flops=False):
        return _per_step(lambda: alg.client_update(1, ss.model, batches, 1.0, 0, net, glob), len(batches), flops)

    fl = {"stage1_cache": one(cached[:1], True), "stage1_live": one(live[:1], True)}
    one(cached[:1]), one(live[:1])  # warm-up
    runs: dict[str, list[float]] = {"stage1_cache": [], "stage1_live": []}
    for _ in range(repeats):
        runs["stage1_cache"].append(one(cached))
        runs["stage1_live"].append(one(live))
    out = {k: _stats(v) for k, v in runs.items()}
    out["stage1_live_over_cache"] = out["stage1_live"]["median"] / out["stage1_cache"]["median"]
    out["flops_per_step"] = {k: round(v) for k, v in fl.items()}
    out["stage1_flop_ceiling"] = fl["stage1_live"] / fl["stage1_cache"]
    out["setting"] = {"batch_size": batch, "steps_per_timing": steps, "mu": fd.mu, "weights": "random",
                      "image_tokens": "resnet50 (timm, 224 px)@layer4: 49 x 2048",
                      "text_tokens": f"BERT-base-sized (12 x 768, {T} tokens)@layer.11: {T} x 768"}
    return out


def part_methods(store: str, seeds: tuple[int, ...], quick: bool, work: Path,
                 methods: tuple[str, ...] = METHODS, mu: float | None = None,
                 rounds: int | None = None, steps: int | None = None, probe: bool = False) -> dict:
    from fedheads.alignment.probe import ProbeOptions
    from fedheads.alignment.runner import feddra_run

    opts = _opts(baselines=methods, seeds=seeds, overwrite=True,
                 probe=ProbeOptions(manifest=str(PROBE)) if probe else None)
    if mu is not None:  # the weight of L_C (Eq. 1) for every method that has the constraint
        opts = dataclasses.replace(opts, fd=dataclasses.replace(opts.fd, mu=mu))
    if rounds or steps:  # a longer run than the quick preset's (the rest of the preset kept)
        opts = dataclasses.replace(opts, fd=dataclasses.replace(opts.fd, rounds=rounds or opts.fd.rounds,
                                                                steps=steps or opts.fd.steps))
    if quick:  # one round of 2 steps: checks the part runs end to end, says nothing about the methods
        opts = dataclasses.replace(opts, fd=dataclasses.replace(opts.fd, rounds=1, steps=2))
    t = time.perf_counter()
    res = feddra_run(str(MANIFEST), store, IMAGE, TEXT, work / "methods", opts)
    out = {"wall_minutes": (time.perf_counter() - t) / 60, "seeds": list(seeds), "rounds": opts.fd.rounds, "mu": opts.fd.mu,
           "steps": opts.fd.steps, "batch_size": opts.fd.batch_size, "methods": {}}
    runs = res["algorithms"] if "algorithms" in res else {methods[0]: res}  # one method: its own results.json
    for name, r in runs.items():
        ret = r["retrieval"]
        out["methods"][name] = {
            m: {"mean": ret[m]["mean"], "worst": ret[m]["worst"]}
            for m in ("t2i_r1", "t2i_r5", "i2t_r1", "chance_r1", "class_r1")}
        out["methods"][name]["wall_minutes"] = r["timing"]["wall_seconds"] / 60
        out["methods"][name]["final_lambda"] = r["lambda"]["final_mean"]
        run_dir = work / "methods" / name if "algorithms" in res else work / "methods"
        out["methods"][name]["t2i_r1_per_seed"] = _per_seed(run_dir)
        if r.get("probe"):  # {feature: {k: {mean, std over seeds}}}; per seed: {k: {mean, std, values over draws}}
            p = r["probe"]
            out["probe_setting"] = {k: p[k] for k in ("manifest_hash", "n_train", "n_test", "shots", "draws")}
            out["methods"][name]["probe"] = {f: p[f] for f in ("z", "pooled", "backbone") if f in p}
            out["methods"][name]["probe_per_seed"] = {
                str(s): {f: {k: v["mean"] for k, v in ps[f].items()} for f in ("z", "pooled", "backbone")
                         if f in ps and "skipped" not in ps[f]} for s, ps in zip(seeds, p["per_seed"])}
    if "fedavg" in out["methods"]:
        base = out["methods"]["fedavg"]["t2i_r1_per_seed"]
        out["t2i_r1_vs_fedavg"] = {n: _paired(m["t2i_r1_per_seed"], base) for n, m in out["methods"].items() if n != "fedavg"}
    return out


@click.command()
@click.option("--part", default="speed,methods", show_default=True)
@click.option("--repeats", default=7, show_default=True)
@click.option("--steps", default=5, show_default=True, help="Local steps per timed client_update.")
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--store", default=None, help="A store holding the two token backbones for the manifest.")
@click.option("--work", default=None, type=click.Path())
@click.option("--methods", default=",".join(METHODS), show_default=True, help="Presets compared by the methods part.")
@click.option("--mu", type=float, default=None, help="Weight of L_C for the methods part (default: the quick preset's).")
@click.option("--rounds", type=int, default=None, help="Rounds for the methods part (default: the quick preset's 4).")
@click.option("--steps-per-stage", "steps_per_stage", type=int, default=None,
              help="Local steps per stage for the methods part (default: the quick preset's 5).")
@click.option("--probe", is_flag=True, help="Methods part: also the few-shot probe on webcam + dslr (1 and 5 shots, "
              "5 draws; the aligned z, the trained encoder's pooled output and the pre-trained backbone's).")
@click.option("--quick", is_flag=True, help="3 repeats, seed 0, methods 1 round x 2 steps: a check that it runs, not figures.")
@click.option("--out", "out_path", default=str(OUT), show_default=True)
def main(part, repeats, steps, seeds, store, work, methods, mu, rounds, steps_per_stage, probe, quick,
         out_path) -> None:
    os.chdir(REPO)  # the manifest's source is ../shared/data/office_caltech10, relative to the checkout
    if not data_dir("office_caltech10").is_dir() or not (REPO.parent / "shared" / "data").is_dir():
        raise SystemExit("needs Office-Caltech-10 at ../shared/data/office_caltech10 beside the checkout")
    seed_t = (0,) if quick else tuple(int(s) for s in seeds.split(","))
    repeats = 3 if quick else repeats
    wd = Path(work) if work else Path(tempfile.mkdtemp(prefix="bench_feddra_"))
    wd.mkdir(parents=True, exist_ok=True)
    st, extract_s = _store(wd, store)
    res = {"benchmark": "feddra", "quick": quick, "manifest": MANIFEST.name, "machine": machine_facts(),
           "load_average_before": os.getloadavg(), "extract_seconds": extract_s}
    parts = part.split(",")
    if "speed" in parts:
        res["speed"] = part_speed(st, repeats, steps)
        s = res["speed"]
        print(f"stage 1 s/step: cache {s['stage1_cache']['median']:.3f}, live {s['stage1_live']['median']:.3f} "
              f"(x{s['stage1_live_over_cache']:.1f}); stage 2 s/step: quick {s['stage2_quick']['median']:.3f}, "
              f"paper {s['stage2_paper']['median']:.3f}")
    if "speed-paper-sized" in parts:
        res["speed_paper_sized"] = part_speed_paper_sized(max(3, repeats // 2), 2)
        s = res["speed_paper_sized"]
        print(f"paper-sized encoders, stage 1 s/step: cache {s['stage1_cache']['median']:.3f}, "
              f"live {s['stage1_live']['median']:.3f} (x{s['stage1_live_over_cache']:.1f}, "
              f"FLOP ceiling x{s['stage1_flop_ceiling']:.1f})")
    if "methods" in parts:
        res["methods"] = part_methods(st, seed_t, quick, wd, tuple(methods.split(",")), mu, rounds, steps_per_stage,
                                      probe)
        for name, m in res["methods"]["methods"].items():
            cell = {k: f"{m[k]['mean']['mean']:.2f} worst {m[k]['worst']['mean']:.2f}" for k in ("t2i_r1", "t2i_r5")}
            print(f"{name:14s} t2i R@1 mean {cell['t2i_r1']}  R@5 mean {cell['t2i_r5']}  "
                  f"(chance R@1 {m['chance_r1']['mean']['mean']:.2f}, class-only {m['class_r1']['mean']['mean']:.2f})")
        for name, m in res["methods"]["methods"].items():
            for f, by_k in m.get("probe", {}).items():
                if "skipped" not in by_k:
                    print(f"{name:14s} probe {f:8s} " + "  ".join(f"{k}-shot {v['mean']:.2f} ({v['std']:.2f})"
                                                                for k, v in by_k.items()))
        for name, c in res["methods"].get("t2i_r1_vs_fedavg", {}).items():
            w = c["worst"]
            print(f"{name} - fedavg, worst-client t2i R@1 over seeds {c['seeds']}: {w['diff_mean']:+.2f} "
                  f"(wins {w['wins']}, losses {w['losses']}, sign test p = {w['sign_test_p']:.3f})")
    res["load_average_after"] = os.getloadavg()
    write_json(res, out_path)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
