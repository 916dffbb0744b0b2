"""Speed of the MiniLM text encoder (minilm-l6-v2) on this machine -> benchmarks/results/text_encoder.json.

    python benchmarks/bench_text_encoder.py [--batch 64] [--repeats 5] [--loads 3] [--quick]

- ``load_seconds``: ``create_backbone("minilm-l6-v2")`` in a fresh process (sha256 of the 91 MB file,
  safetensors read, tokenizer) after the imports, and the whole process including ``import torch``;
  median of ``--loads`` processes;
- ``embed``: captions/s of ``Backbone.embed`` (tokenize + encode + pool, inference mode);
- ``token_states``: captions/s of the token shard rows (``minilm-l6-v2:32@layer.5`` ``embed_texts``);
- ``fwd_bwd_whole``: forward + backward of the whole TextStagedNet (train mode: dropout on), loss =
  a random projection of the pooled output; ``train_step_whole`` adds the AdamW step (22.6M
  parameters, the 11.7M-entry word embedding included);
- ``fwd_bwd_last_layer`` / ``train_step_last_layer``: the same from cached ``layer.4`` states (only
  layer.5 and the pool run and train).
Captions: FedDRA-style, 9-24 tokens ([CLS]/[SEP] included), fixed per seed. Median and spread over
``--repeats`` timed batches after one warm-up batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from bench_backbone_speed import _rate as rate  # sibling modules (benchmarks/ is on sys.path)
from machine_info import machine_facts, write_json

REPO = Path(__file__).resolve().parents[1]
NAME = "minilm-l6-v2"
CLASSES = ("backpack", "bike", "calculator", "headphones", "keyboard", "laptop", "monitor", "mouse", "mug", "projector")
TEMPLATES = ("a photo of a {c}.", "a {col} {c} on a {bg} background, seen from the {side}.",
             "an {dom} product image of a {col} {c}.", "a close-up picture of the {c} in an office, {col} and {side}.")


def captions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(TEMPLATES).format(c=rng.choice(CLASSES), col=rng.choice(("red", "black", "white", "silver")),
                                         bg=rng.choice(("white", "dark", "cluttered")), side=rng.choice(("front", "side")),
                                         dom=rng.choice(("amazon", "caltech"))) for _ in range(n)]


def _rate(fn, batch: int, repeats: int) -> dict:
    return rate(fn, batch, repeats, unit="captions_per_s")


_LOAD = ("import time; t0 = time.perf_counter(); import torch; from embedcache.backbones import create_backbone; "
         "t1 = time.perf_counter(); create_backbone({name!r}); t2 = time.perf_counter(); print(t2 - t1, t2 - t0)")


def load_seconds(loads: int) -> dict:
    runs = []
    for _ in range(loads):
        out = subprocess.run([sys.executable, "-c", _LOAD.format(name=NAME)], capture_output=True, text=True,
                             check=True, cwd=REPO)
        runs.append([float(v) for v in out.stdout.split()[-2:]])
    return {"create_backbone": round(statistics.median(r[0] for r in runs), 3),
            "process_with_imports": round(statistics.median(r[1] for r in runs), 3), "loads": loads}


def _train_step(net, ids, mask, start=None, x=None, optimizer: bool = True):
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=2e-5)
    r = torch.randn(net.feature_dim, generator=torch.Generator().manual_seed(0))
    inp = ids if start is None else x

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        (net(inp, start=start, mask=mask) @ r).square().mean().backward()
        if optimizer:
            opt.step()

    return step


def bench(batch: int, repeats: int) -> dict:
    from embedcache.backbones import create_backbone

    bb = create_backbone(NAME)
    texts = captions(batch)
    lengths = bb.token_lengths(texts)
    ids, mask = bb.tokenize(texts)
    out: dict = {"backbone": NAME, "tokens_per_caption": {"min": min(lengths), "max": max(lengths),
                                                          "mean": round(sum(lengths) / len(lengths), 1)},
                 "embed": _rate(lambda: bb.embed(texts), batch, repeats)}
    tok32 = create_backbone(f"{NAME}:32@layer.5")
    out["token_states"] = _rate(lambda: tok32.embed_texts(texts), batch, repeats)
    net = bb.trainable().train()
    out["fwd_bwd_whole"] = _rate(_train_step(net, ids, mask, optimizer=False), batch, repeats)
    out["train_step_whole"] = _rate(_train_step(net, ids, mask), batch, repeats)
    with torch.no_grad():
        cached = net.eval()(ids, stop="layer.4", mask=mask)
    net.train().requires_grad_(False)
    for s in ("layer.5", "pool"):
        net.stage(s).requires_grad_(True)
    out["fwd_bwd_last_layer"] = _rate(_train_step(net, ids, mask, "layer.4", cached, optimizer=False), batch, repeats)
    out["train_step_last_layer"] = _rate(_train_step(net, ids, mask, start="layer.4", x=cached), batch, repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loads", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="batch 4, 1 repeat, 1 load (checks that it runs)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "text_encoder.json"))
    args = p.parse_args()
    batch, repeats, loads = (4, 1, 1) if args.quick else (args.batch, args.repeats, args.loads)
    from embedcache.backbones import list_backbones

    row = {r.name: r for r in list_backbones()}[NAME]
    if not row.available:
        print(f"note: {NAME} unavailable ({row.reason}); nothing measured", file=sys.stderr)
        return
    load_start = os.getloadavg()
    result = {"load_seconds": load_seconds(loads), **bench(batch, repeats)}
    print(json.dumps(result), flush=True)
    write_json({"benchmark": "text_encoder", "quick": args.quick, **machine_facts(), "results": result,
                "load_average": {"start": load_start, "end": os.getloadavg()},
                "note": "median (min, max) over the repeats; captions FedDRA-style, dynamic padding"}, args.out)


if __name__ == "__main__":
    main()
