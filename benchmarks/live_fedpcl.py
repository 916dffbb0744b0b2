"""The "live backbone" FedPCL baseline: the authors' per-round loop, on OUR FedPCL maths.

What the code of the FedPCL authors (GitHub yuetan031/FedPCL) does for Algorithm 1 of Tan et
al., "Federated Learning from Pre-Trained Models: A Contrastive Learning Approach", NeurIPS 2022
(Sec. 4): nothing is cached. Every round, clients one after another
  1. run every frozen backbone forward on every training batch (images re-decoded and
     re-preprocessed by a DataLoader with worker processes) and take one optimiser step on the
     head (E local epochs, batch 32, Adam lr 1e-3, wd 1e-4);
  2. run the backbones again over the training set to build the local prototypes (Eq. 5);
  3. run the backbones again over the test set to evaluate (nearest local prototype);
then the server aggregates (Eq. 6-7). This module re-creates that loop exactly, with the head,
loss (Eq. 8-10 or the code variant), optimiser, prototype and aggregation functions taken from
`fedheads.algorithms.fedpcl` (the same definition the cached engine runs), so the ONLY
difference from `fedheads train --algorithm fedpcl` is where the features come from.

Fairness notes (see benchmarks/bench_cached_vs_live.py): DataLoaders are persistent (workers
start once, not every round: a concession in the baseline's favour), each backbone group with an
identical preprocess dict shares one decoded+transformed tensor (the authors' code also
transforms once for all backbones), no feature is kept between passes or rounds.

`batch_order="engine"` replays the cached engine's seeded per-client schedule
(fedheads.core.batching) instead of a DataLoader shuffle; then live and cached runs agree up to
float rounding, which tests/test_bench_smoke.py checks."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from embedcache.errors import UserError
from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig, FedPCLMessage
from fedheads.core import heads, rng
from fedheads.core.batching import make_schedule
from fedheads.core.federation import DataSpec
from fedheads.core.ops import class_sums
from fedheads.core.optim import opt_init, opt_step
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import tree_cat, tree_index, tree_scatter


@dataclass(frozen=True)
class LiveConfig:
    """Settings of one live-backbone FedPCL run."""

    rounds: int = 5  # communication rounds (round 0 only collects prototypes, as in the engine)
    seed: int = 0  # run seed: head initialisation and batch order
    num_workers: int = 2  # DataLoader worker processes per loader (decode + preprocess)
    eval_batch_size: int = 64  # rows per forward pass for the prototype and test passes
    batch_order: str = "shuffle"  # "shuffle" (DataLoader-style, seeded) | "engine" (cached engine's schedule)
    fedpcl: FedPCLConfig = field(default_factory=FedPCLConfig)  # head, loss, optimiser, batch size, E
    progress: bool = True  # tqdm bar over rounds


@dataclass(frozen=True)
class LiveRound:
    """Timing (seconds) and accuracy of one live round."""

    round: int  # 0-based
    train_s: float  # decode + backbones + head steps over every client's training batches
    proto_s: float  # decode + backbones + head over every training set (Eq. 5)
    eval_s: float  # decode + backbones + head + nearest prototype over every test set
    aggregate_s: float  # server Eq. 6-7
    total_s: float  # wall time of the whole round
    accuracy: tuple[float, ...]  # per-client test accuracy (main rule), in manifest client order
    images_decoded: int  # images decoded and preprocessed this round (all clients, all passes)


@dataclass
class LiveResult:
    """A live run: per-round records and the final states."""

    clients: tuple[str, ...]
    rounds: list[LiveRound] = field(default_factory=list)
    client_state: Any = None
    server_state: Any = None
    wall_seconds: float = 0.0

    def final_accuracy(self) -> tuple[float, ...]:
        return self.rounds[-1].accuracy


class ImageSplit(Dataset):
    """One client's split: decode the image and apply each preprocess group's transform.

    Returns (tuple of [C,H,W] tensors, one per preprocess group, label). Nothing is cached."""

    def __init__(self, source: Any, samples: Sequence[Any], transforms: Sequence[Any]) -> None:
        self.source = source
        self.items = [(s.locator, int(s.label)) for s in samples]
        self.transforms = list(transforms)  # backbones, one per group: .transform(img, train=False)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, ...], int]:
        loc, label = self.items[i]
        img = self.source.load(loc)
        return tuple(bb.transform(img, train=False) for bb in self.transforms), label


class RoundBatches(Sampler[list[int]]):
    """Per-round training batches of one client, reseeded by `set_round` (a persistent
    DataLoader re-iterates its batch sampler in the main process every epoch).

    "shuffle": a fresh permutation per (seed, round, client, epoch), batches of B, the last one
    partial (no drop_last, like the engine, unlike the authors' loader). "engine": the cached
    engine's own schedule (fedheads.core.batching.make_schedule for this client alone)."""

    def __init__(self, n: int, client_index: int, batch_size: int, epochs: int, seed: int, order: str) -> None:
        if order not in ("shuffle", "engine"):
            raise UserError(f"batch_order {order!r}: must be 'shuffle' or 'engine'")
        self.n, self.ci, self.B, self.E, self.seed, self.order = n, client_index, batch_size, epochs, seed, order
        self.round = 0

    def set_round(self, r: int) -> None:
        self.round = r

    def __len__(self) -> int:
        return self.E * ((self.n + self.B - 1) // self.B)

    def __iter__(self) -> Iterator[list[int]]:
        if self.order == "engine":
            s = make_schedule([self.n], torch.tensor([self.ci]), self.B, self.E, self.seed, self.round)
            for k in range(s.num_steps):
                yield s.index[k, 0][s.valid[k, 0]].tolist()
            return
        for e in range(self.E):
            g = torch.Generator().manual_seed(int(rng.hash_keys(self.seed, self.round, self.ci, e, 0x5EED).item()))
            perm = torch.randperm(self.n, generator=g).tolist()
            for a in range(0, self.n, self.B):
                yield perm[a:a + self.B]


def _groups(backbones: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """Backbones with identical preprocess dicts share one transformed tensor: (one backbone per
    group, group index of each backbone)."""
    keys: dict[str, int] = {}
    reps: list[Any] = []
    of: list[int] = []
    for bb in backbones:
        k = json.dumps(bb.preprocess, sort_keys=True, default=str)
        if k not in keys:
            keys[k] = len(reps)
            reps.append(bb)
        of.append(keys[k])
    return reps, of


def _features(backbones: Sequence[Any], group_of: Sequence[int], xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenated frozen features [B, sum D_k] (FedPCL Eq. 1-2), as a normal (non-inference)
    tensor: embed() runs in inference mode, and autograd may not save inference tensors."""
    with torch.inference_mode():
        f = torch.cat([bb.embed(xs[g]) for bb, g in zip(backbones, group_of)], dim=1)
    return f.clone()


def run_live(manifest: Any, source: Any, backbones: Sequence[Any], cfg: LiveConfig = LiveConfig()) -> LiveResult:
    """FedPCL with a live forward pass through every frozen backbone in every pass of every
    round (module docstring). `manifest` follows contract 1, `source` contract 2, `backbones`
    contract 3 (in the order their features are concatenated)."""
    if cfg.rounds < 1:
        raise UserError(f"rounds {cfg.rounds}: must be >= 1")
    if cfg.fedpcl.noise != "none":
        raise UserError(f"noise {cfg.fedpcl.noise!r}: the live baseline runs without prototype noise")
    if not backbones:
        raise UserError("backbones: at least one is needed")
    fc = cfg.fedpcl
    clients = list(manifest.clients)
    M, C = len(clients), len(manifest.classes)
    reps, group_of = _groups(backbones)
    dim = sum(int(bb.feature_dim) for bb in backbones)
    n_train = tuple(len(manifest.samples(c.name, "train")) for c in clients)
    if min(n_train) == 0:
        raise UserError(f"{clients[n_train.index(0)].name}: no training samples")
    for bb in reps:  # build the transforms (and import torchvision) once here, before workers fork,
        bb.transform(Image.new("RGB", (8, 8)))  # as the authors' script does at import time
    pw = cfg.num_workers > 0
    kw: dict[str, Any] = dict(num_workers=cfg.num_workers, persistent_workers=pw)
    train_sets = [ImageSplit(source, manifest.samples(c.name, "train"), reps) for c in clients]
    test_sets = [ImageSplit(source, manifest.samples(c.name, "test"), reps) for c in clients]
    samplers = [RoundBatches(n_train[i], i, fc.batch_size, fc.local_epochs, cfg.seed, cfg.batch_order) for i in range(M)]
    train_loaders = [DataLoader(ds, batch_sampler=s, **kw) for ds, s in zip(train_sets, samplers)]
    proto_loaders = [DataLoader(ds, batch_size=cfg.eval_batch_size, shuffle=False, **kw) for ds in train_sets]
    test_loaders = [DataLoader(ds, batch_size=cfg.eval_batch_size, shuffle=False, **kw) if len(ds) else None
                    for ds in test_sets]

    alg = FedPCL(fc)
    init = alg.init(DataSpec(dim, C, M, n_train, torch.device("cpu")), cfg.seed)
    cstate, sstate, bc = init.client_state, init.server_state, init.broadcast
    spec = alg._spec(cstate.params)  # the head's shape, read from its state
    res = LiveResult(clients=tuple(c.name for c in clients))
    t_run = time.perf_counter()
    for r in tqdm(range(cfg.rounds), desc="fedpcl[live]", disable=not cfg.progress, leave=False):
        t0 = time.perf_counter()
        ctx = RoundCtx(round=r, seed=cfg.seed, participants=torch.arange(M), num_clients=M)
        loss_fn = alg._loss_fn(bc, spec)  # the engine's exact loss closure (Eq. 8-10 / code variant)
        msgs, t_train, t_proto, decoded = [], 0.0, 0.0, 0
        for i in range(M):  # clients one after another, as the authors' code
            one = torch.tensor([i])
            cs = tree_index(cstate, one)
            p, b, opt = cs.params, cs.buffers, cs.opt
            ta = time.perf_counter()
            if not bc.collect_only:
                if fc.reset_optimizer:
                    opt = opt_init(fc.optimizer, p)
                samplers[i].set_round(r)
                for xs, y in train_loaders[i]:
                    x = _features(backbones, group_of, xs).unsqueeze(0)  # [1,B,D]
                    yb = y.unsqueeze(0)
                    valid = torch.ones_like(yb, dtype=torch.bool)
                    leaf = {k: v.detach().requires_grad_(True) for k, v in p.items()}
                    with torch.enable_grad():
                        loss, nb = loss_fn(leaf, b, x, yb, valid)
                        grads = torch.autograd.grad(loss.sum(), list(leaf.values()), allow_unused=True)
                    g = {k: (gk if gk is not None else torch.zeros_like(p[k])) for k, gk in zip(leaf, grads)}
                    p, opt = opt_step(fc.optimizer, {k: v.detach() for k, v in p.items()}, g, opt,
                                      torch.ones(1, dtype=torch.bool))
                    b = {k: v.detach() for k, v in nb.items()}
                    decoded += len(y)
            tb = time.perf_counter()
            # Eq. 5: prototypes over the client's full training set, head in eval mode
            sums = torch.zeros(1, C, spec.hidden)
            counts = torch.zeros(1, C)
            with torch.no_grad():
                for xs, y in proto_loaders[i]:
                    x = _features(backbones, group_of, xs).unsqueeze(0)
                    m = torch.ones(1, len(y), dtype=torch.bool)
                    z, _ = heads.embed(spec, p, b, alg._x(x), m, train=False)  # as client_update
                    s, c = class_sums(z, y.unsqueeze(0), m, C)
                    sums, counts = sums + s, counts + c
                    decoded += len(y)
            protos = sums / counts.clamp_min(1).unsqueeze(-1)
            present = counts > 0
            t_train += tb - ta
            t_proto += time.perf_counter() - tb
            # the engine keeps only the step counter when the optimiser is reset every round
            new_cs = type(cs)(p, b, cs.opt if fc.reset_optimizer else opt, protos, present)
            cstate = tree_scatter(cstate, one, new_cs)
            msgs.append(FedPCLMessage(protos, counts.to(torch.float32), present))
        ta = time.perf_counter()
        sstate, bc = alg.server_aggregate(sstate, tree_cat(msgs), ctx)
        t_agg = time.perf_counter() - ta
        te = time.perf_counter()
        acc = []
        for i in range(M):
            cs = tree_index(cstate, torch.tensor([i]))
            hit = tot = 0
            if test_loaders[i] is not None:
                with torch.no_grad():
                    for xs, y in test_loaders[i]:
                        x = _features(backbones, group_of, xs).unsqueeze(0)
                        scores = alg.predict(cs, sstate, x, torch.ones(1, len(y), dtype=torch.bool))["main"]
                        hit += int((scores[0].argmax(-1) == y).sum())
                        tot += len(y)
                        decoded += len(y)
            acc.append(hit / tot if tot else float("nan"))
        t_eval = time.perf_counter() - te
        res.rounds.append(LiveRound(r, t_train, t_proto, t_eval, t_agg, time.perf_counter() - t0, tuple(acc), decoded))
    res.client_state, res.server_state = cstate, sstate
    res.wall_seconds = time.perf_counter() - t_run
    return res

