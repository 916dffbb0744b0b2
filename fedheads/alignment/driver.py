"""The FedDRA driver: rounds over paired clients with ONE workspace network on the device plus one
frozen copy of the global model (the anchor z* of L_C, the re-encoder of stale caches and the
evaluated model).

Round r (feddra.py for the maths): for each stage of the round (FedDRAConfig.plan), every client
loads the broadcast into the workspace, trains, and its message is added to the server's sums
right away; then the server finalises the stage. After the round's last stage the server updates
lambda from the clients' v_i. The rounds, their timing, the evaluation (retrieval per client, in
the rounds the run's schedule names), the per-round checkpoint (global model, lambda, history) and resume
are the live round loop's (fedheads.finetuning.rounds). Every random choice is a pure function of
(seed, round, client, stage, ...), so a run killed at any point and resumed ends with the same
weights and lambda.

Stage-1 inputs are the encoders' token states: from the cache while it is fresh (the store's
shards were made by the pre-trained encoders, version 0; after a stage 2 changes the encoders,
version = that round), else (`stage1_inputs`) "reencode" the client's training split once with
the global encoders (costs n_i encoder passes), "live" (encode each batch: E*B passes), or "auto"
(re-encode when E*B >= n_i). A modality whose encoder is frozen in stage 2 always reads the cache.
Stage 1 from the cache runs no encoder and reads no image; its cost is the alignment modules'
own passes, and the anchor z* of L_C (fixed for the round on fixed inputs) is computed once per
training row (anchor_outputs) instead of once per step when E*B > n_i.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.alignment.algorithm import FDServerState, FedDRA
from fedheads.alignment.evaluation import retrieval
from fedheads.alignment.model import DualEncoder, is_module_key
from fedheads.alignment.pairs import EVAL_BATCH, PairClient, TokenCache, dro_rows, encode_cache, eval_batches, step_rows
from fedheads.core import rng
from fedheads.core.tree import payload_size
from fedheads.finetuning.data import seeded
from fedheads.finetuning.rounds import Checkpoint, LiveRound, LiveRun, run_rounds

CKPT_FORMAT = "fedheads-feddra-ckpt/1"
STAGE1_INPUTS = ("auto", "reencode", "live")


@dataclass
class FDRound(LiveRound):
    """One FedDRA round (round 0: the starting model, nothing trained or sent)."""

    stages: list[int] = field(default_factory=list)
    scale: list[float] = field(default_factory=list)  # s_i used in this round (from lambda^r)
    v: list[float] = field(default_factory=list)  # v_i measured after the round
    lam: list[float] = field(default_factory=list)  # lambda after the round (round 0: lambda^0)
    comm: dict[str, dict[str, int]] = field(default_factory=dict)  # "stage1"/"stage2": up/down values and bytes
    compute_F: float = 0.0  # encoder forward-pass units of this round (docs/contracts.md section 10)
    reencoded: int = 0  # samples re-encoded for stage 1 (stale caches)
    retrieval: list[dict[str, float]] | None = None  # per client (fractions), None if not evaluated


FDRun = LiveRun  # FedDRA's run: rounds are FDRounds, state an FDServerState


def _seed(seed: int, round_: int, client: int, stage: int) -> int:
    return int(rng.hash_keys(seed, round_, client, stage, 0xFD2))


_RUNS = itertools.count(1)


class _Inputs:
    """Which token states a client's batches read (None: live encoder passes). `version` names
    the global encoders: 0 while they are the pre-trained ones, else (run token, round) of the
    stage 2 that last changed them, so no run ever reads another run's re-encoded cache."""

    def __init__(self, net: DualEncoder, mode: str) -> None:
        if mode not in STAGE1_INPUTS:
            raise UserError(f"stage1_inputs {mode!r}: use one of {', '.join(STAGE1_INPUTS)}")
        self.net, self.mode, self.run = net, mode, next(_RUNS)
        self.version: object = 0

    def token(self, r: int) -> object:
        """The name of the global encoders that round r's stage 2 left (r = 0: the pre-trained ones)."""
        return 0 if r == 0 else (self.run, r)

    def set_round(self, r: int) -> None:
        self.version = self.token(r)

    def pick(self, c: PairClient, split: str) -> tuple[TokenCache | None, TokenCache | None]:
        """Token states of the current global encoders; a frozen encoder's from any cache."""
        sp = c.split(split)
        now, anyc = sp.cache_for(self.version), sp.any_cache()
        return (now or (anyc if not self.net.image_stages else None),
                now or (anyc if not self.net.text_stages else None))

    def stage2(self, c: PairClient) -> tuple[TokenCache | None, TokenCache | None]:
        """During and after a stage 2 only a frozen encoder's modality comes from a cache."""
        anyc = c.train.any_cache()
        return (anyc if not self.net.image_stages else None, anyc if not self.net.text_stages else None)


@torch.no_grad()
def evaluate(alg: FedDRA, glob: DualEncoder, clients: Sequence[PairClient], inputs: _Inputs, device: torch.device,
             seed: int) -> list[dict[str, float]]:
    """Retrieval per client of the global model (loaded in `glob`) on its test split."""
    glob.eval()
    out = []
    for c in clients:
        n = c.test.n
        rows = [np.arange(a, min(a + EVAL_BATCH, n)) for a in range(0, n, EVAL_BATCH)]
        img_c, txt_c = inputs.pick(c, "test")
        zx, zy = [], []
        for b in c.batches("test", rows, device, img=img_c, txt=txt_c):
            a, t = alg.embed(glob, b, 1)
            zx.append(a.float().cpu())
            zy.append(t.float().cpu())
        if not zx:
            out.append(retrieval(torch.zeros(0, 1), torch.zeros(0, 1), (), c.test.labels, []))
            continue
        out.append(retrieval(torch.cat(zx), torch.cat(zy), c.test.texts, c.test.labels,
                             eval_batches(n, c.index, seed)))
    return out


@torch.no_grad()
def anchor_outputs(alg: FedDRA, glob: DualEncoder, c: PairClient, img: TokenCache, txt: TokenCache,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """z* of L_C (Sec. 4.1) for every training row of `c`: the frozen global model on the cached
    token states. In stage 1 the anchor and its inputs stay fixed for the whole round, so this is
    n_i module passes once instead of one per step (E*B): the anchor was a third of a step's work."""
    glob.eval()
    rows = [np.arange(a, min(a + EVAL_BATCH, c.n_train)) for a in range(0, c.n_train, EVAL_BATCH)]
    zx, zy = [], []
    for b in c.batches("train", rows, device, img=img, txt=txt):
        a, t = alg.embed(glob, b, 1)
        zx.append(a.float())
        zy.append(t.float())
    return torch.cat(zx), torch.cat(zy)


def _encoders_version(plan: list[tuple[int, ...]], done: int, trains_encoders: bool) -> int:
    """The round whose stage 2 last changed the encoders (0: pre-trained)."""
    if not trains_encoders:
        return 0
    return max([r for r in range(1, done + 1) if 2 in plan[r - 1]], default=0)


def _held_encoders(plan: list[tuple[int, ...]], done: int, trains_encoders: bool) -> int | None:
    """The round whose encoders the clients were last sent, after `done` rounds (0: pre-trained,
    None: none sent yet): those at the start of round `done`'s last stage. A function of the plan,
    so a resumed run counts the down-link exactly as an uninterrupted one."""
    if done == 0:
        return None
    if trains_encoders and 2 in plan[done - 1][:-1]:
        return done
    return _encoders_version(plan, done - 1, trains_encoders)


def run_feddra(alg: FedDRA, net: DualEncoder, glob: DualEncoder, clients: Sequence[PairClient], *, seed: int,
               device: torch.device, checkpoint: Checkpoint | None = None, resume: bool = False,
               evaluates: Callable[[int, int], bool] = lambda r, n: True, augment: bool = True,
               stage1_inputs: str = "auto", progress: bool = True, on_round: Callable[[FDRound], None] | None = None) -> FDRun:
    """Train FedDRA for `alg.cfg.rounds` rounds; see the module docstring."""
    cfg = alg.cfg
    plan = cfg.plan()
    if any(2 in p for p in plan) and not net.trains_encoders:
        raise UserError("stage 2 trains the encoders, but both are frozen (image_trainable/text_trainable); "
                        "use --set schedule=sequential --set stage1_rounds=R for a stage-1-only run")
    N = len(clients)
    inputs = _Inputs(net, stage1_inputs)
    ss = alg.init(net, N)
    B_v = min(cfg.batch_size, min(c.n_train for c in clients))  # one v batch size for all ([R])
    enc_keys = [k for k in ss.model.params if not is_module_key(k)] + list(ss.model.buffers)
    mod_keys = [k for k in ss.model.params if is_module_key(k)]

    def train(r: int, ss: FDServerState) -> tuple[FDServerState, FDRound]:
        inputs.set_round(_encoders_version(plan, r - 1, net.trains_encoders))  # those after round r-1 (a resumed run)
        held = _held_encoders(plan, r - 1, net.trains_encoders)
        sent_version: object = -1 if held is None else inputs.token(held)  # encoder version the clients hold (-1: none yet)
        stages = plan[r - 1]
        scales = alg.scales(ss)
        rec = FDRound(r, list(stages), scale=scales.tolist())
        v = torch.full((N,), math.nan, dtype=torch.float64)
        for st in stages:
            glob.load_state({**ss.model.params, **ss.model.buffers})  # frozen global copy (Alg. 2/3 line 3)
            glob.eval()
            down = mod_keys + (enc_keys if sent_version != inputs.version else [])
            sent_version = inputs.version
            dv, db = payload_size({k: ss.model.params.get(k, ss.model.buffers.get(k)) for k in down}, per_client=False)
            cs = rec.comm.setdefault(f"stage{st}", {"up_values": 0, "up_bytes": 0, "down_values": 0, "down_bytes": 0})
            sums = alg.sums_init(ss)
            value_here = st == stages[-1] and cfg.dro_model == "local"
            for c in clients:
                rows = step_rows(c.n_train, c.index, cfg.batch_size, cfg.steps, seed, r - 1, st)
                anc = None
                if st == 1:
                    img_c, txt_c = inputs.pick(c, "train")
                    if (img_c is None or txt_c is None) and (inputs.mode == "reencode" or (
                            inputs.mode == "auto" and cfg.steps * len(rows[0]) >= c.n_train)):
                        n_enc = encode_cache(glob, [c], device, inputs.version, splits=("train",))
                        rec.reencoded += n_enc
                        rec.compute_F += n_enc
                        img_c, txt_c = inputs.pick(c, "train")
                    rec.compute_F += 0 if (img_c is not None and txt_c is not None) else len(rows) * len(rows[0])
                    if (cfg.mu > 0 and img_c is not None and txt_c is not None
                            and cfg.steps * len(rows[0]) > c.n_train):
                        anc = anchor_outputs(alg, glob, c, img_c, txt_c, device)
                else:
                    img_c, txt_c = inputs.stage2(c)
                    rec.compute_F += (3 + (1 if cfg.mu > 0 else 0)) * len(rows) * len(rows[0])
                aug = (seed, 2 * (r - 1) + st) if st == 2 and augment else None
                batches = c.batches("train", rows, device, img=img_c, txt=txt_c, augment=aug, anchor=anc)
                vb = None
                if value_here:
                    vrows = dro_rows(c.n_train, c.index, B_v, cfg.dro_batches, seed)
                    vi, vt = (img_c, txt_c) if st == 1 else inputs.stage2(c)
                    vb = c.batches("train", vrows, device, img=vi, txt=vt)
                    rec.compute_F += 0 if (vi is not None and vt is not None) else sum(len(x) for x in vrows)
                with seeded(_seed(seed, r - 1, c.index, st)):  # dropout etc.: a function of (seed, round, client, stage)
                    msg = alg.client_update(st, ss.model, batches, float(scales[c.index]), c.index, net, glob, vb,
                                            weight=float(c.n_train) if cfg.aggregation == "samples" else 1.0)
                uv, ub = payload_size((msg.delta, msg.buffer_delta), per_client=True)
                cs["up_values"] += uv + (1 if value_here else 0)
                cs["up_bytes"] += ub + (8 if value_here else 0)
                cs["down_values"] += dv + 1  # + the client's step scale s_i
                cs["down_bytes"] += db + 8
                sums = alg.sums_add(sums, msg)
                del msg
            ss = alg.server_finalize(ss, sums)
            if st == 2 and net.trains_encoders:
                inputs.set_round(r)
            if value_here:
                v = sums.v.cpu()
        if cfg.dro_model == "global":  # v_i of the new global model on each client's fixed batches
            glob.load_state({**ss.model.params, **ss.model.buffers})
            for c in clients:
                img_c, txt_c = inputs.pick(c, "train")
                vb = c.batches("train", dro_rows(c.n_train, c.index, B_v, cfg.dro_batches, seed), device,
                               img=img_c, txt=txt_c)
                v[c.index] = alg.client_value(glob, glob, vb, stages[-1])
        ss = alg.update_lambda(ss, v)  # Alg. 1 line 18
        rec.v, rec.lam = v.tolist(), ss.lam.tolist()
        return ss, rec

    def evaluate_into(ss: FDServerState, rec: FDRound) -> dict[str, str]:
        glob.load_state({**ss.model.params, **ss.model.buffers})
        rec.retrieval = evaluate(alg, glob, clients, inputs, device, seed)
        return {"r1": f"{100 * np.nanmean([x['t2i_r1'] for x in rec.retrieval]):.1f}"}

    return run_rounds(ss, cfg.rounds, train, evaluate_into, FDRound(0, lam=ss.lam.tolist()), device=device,
                      evaluates=evaluates, checkpoint=checkpoint, resume=resume, progress=progress,
                      desc="feddra", on_round=on_round)


def feddra_checkpoint(path: Any, config: dict[str, Any]) -> Checkpoint:
    return Checkpoint(path, config, fmt=CKPT_FORMAT, record=FDRound)
