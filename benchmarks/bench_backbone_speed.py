"""Images per second of a backbone's frozen embed and of a fine-tuning step through its
StagedNet -> benchmarks/results/backbone_speed.json.

    python benchmarks/bench_backbone_speed.py [--backbones efficientnet-lite0,efficientnet-lite0:160]
        [--batch 32] [--repeats 5] [--quick]

Per backbone, on random input of its own size (no decoding):
- ``embed``: ``Backbone.embed`` as extraction runs it (inference mode; efficientnet-lite0
  channels-last on the CPU);
- ``train_step``: forward + backward + SGD step of the whole StagedNet plus a linear head in
  train mode, default (NCHW) and channels-last memory format;
- ``train_step_after:<cut>``: the same for the stages after the middle cut from a stored map
  (cache-first partial fine-tuning).
Median and spread (min, max) over ``--repeats`` timed batches after one warm-up batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine_info import machine_facts, write_json  # sibling module (benchmarks/ is on sys.path)

from embedcache.backbones import create_backbone

REPO = Path(__file__).resolve().parents[1]


def _rate(fn, batch: int, repeats: int, unit: str = "img_per_s") -> dict:
    fn()  # warm-up: lazy init, first-call kernels
    secs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t0)
    rates = sorted(batch / s for s in secs)
    return {unit: round(statistics.median(rates), 2), "min": round(rates[0], 2), "max": round(rates[-1], 2),
            "repeats": repeats, "batch": batch}


def _train_step(net, head, x, start=None):
    opt = torch.optim.SGD([*net.parameters(), *head.parameters()], lr=1e-3)
    y = torch.zeros(x.shape[0], dtype=torch.long)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(head(net(x, start=start)), y)
        loss.backward()
        opt.step()

    return step


def bench(name: str, batch: int, repeats: int) -> dict:
    bb = create_backbone(name, device="cpu")
    x = torch.randn((batch, *bb.preprocess["input_size"]), generator=torch.Generator().manual_seed(0))
    out: dict = {"backbone": name, "input_size": bb.preprocess["input_size"], "feature_dim": bb.feature_dim,
                 "embed": _rate(lambda: bb.embed(x), batch, repeats)}
    net = bb.trainable().train()
    head = torch.nn.Linear(net.feature_dim, 10)
    out["train_step"] = _rate(_train_step(net, head, x), batch, repeats)
    net_cl = bb.trainable().train().to(memory_format=torch.channels_last)
    out["train_step_channels_last"] = _rate(
        _train_step(net_cl, head, x.contiguous(memory_format=torch.channels_last)), batch, repeats)
    cuts = net.cut_points()
    if cuts:
        cut = cuts[len(cuts) // 2]
        with torch.no_grad():
            maps = net.eval()(x, stop=cut)
        net.train()
        out[f"train_step_after:{cut}"] = _rate(_train_step(net, head, maps, start=cut), batch, repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backbones", default="efficientnet-lite0,efficientnet-lite0:160,resnet20-cifar10")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="batch 4, 1 repeat (checks that it runs)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "backbone_speed.json"))
    args = p.parse_args()
    batch, repeats = (4, 1) if args.quick else (args.batch, args.repeats)
    results = []
    for name in [b.strip() for b in args.backbones.split(",") if b.strip()]:
        r = bench(name, batch, repeats)
        print(json.dumps(r), flush=True)
        results.append(r)
    write_json({"benchmark": "backbone_speed", "quick": args.quick, **machine_facts(), "results": results,
                "note": "random input, no decoding; median (min, max) over the repeats"}, args.out)

if __name__ == "__main__":
    main()
