"""The fine-tuning driver: rounds over live clients with ONE network on the device.

Per round r = 1..R: the participants (fedheads.core.engine.select_participants, the head
engines' seeded choice) each load the broadcast into the one workspace network, train locally
(FineTune.client_update) and have their message added to the server's running sums right away,
so memory holds one model, the global state and the sums, never a model per client; then
FineTune.server_finalize. Round 0 is the evaluation of the starting model (pre-trained stages +
stage-1 head) before any fine-tuning. The rounds, their timing, evaluation cadence, per-round
checkpoint and resume are the live round loop's (fedheads.finetuning.rounds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fedheads.algorithms.pfl_common import GlobalModel
from fedheads.core.engine import select_participants
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import payload_size
from fedheads.finetuning.algorithm import FineTune, FTServerState
from fedheads.finetuning.data import LiveClient, seeded
from fedheads.finetuning.model import LiveNet
from fedheads.finetuning.rounds import Checkpoint, LiveRound, LiveRun, run_rounds
from fedheads.report.metrics import nanmean

CKPT_FORMAT = "fedheads-finetune-ckpt/1"


@dataclass
class FTRound(LiveRound):
    """One fine-tuning round."""

    participants: list[int]
    up_values: int = 0  # sums over participants
    up_bytes: int = 0
    down_values: int = 0
    down_bytes: int = 0
    samples: int = 0  # training samples of the participants (N_s of FedNCM App. A, Eq. 5)
    accuracy: list[float] | None = None  # per client (NaN: no test sample), None if not evaluated
    stats: dict[str, float] = field(default_factory=dict)  # the algorithm's round statistics (FedIT's aggregation gap)


FTRun = LiveRun  # fine-tuning's run: rounds are FTRounds, state an FTServerState


@torch.no_grad()
def evaluate(net: LiveNet, model: GlobalModel | Callable[[int], GlobalModel], clients: Sequence[LiveClient],
             device: torch.device, load: Callable[[LiveNet, GlobalModel], None] = FineTune.load) -> list[float]:
    """Accuracy on each client's test split (NaN for an empty split) of the global model, or of
    each client's own model `model(client index)` (personalised algorithms)."""
    if not callable(model):
        load(net, model)
    net.eval()
    out = []
    for c in clients:
        if callable(model):
            load(net, model(c.index))
            net.eval()
        hit, n = 0, 0
        for x, y in c.test_batches(device):
            hit += int((net(x).argmax(-1) == y).sum())
            n += int(y.numel())
        out.append(hit / n if n else math.nan)
    return out


def finetune_checkpoint(path: Path, config: dict[str, Any]) -> Checkpoint:
    return Checkpoint(path, config, fmt=CKPT_FORMAT, record=FTRound)


def run_finetune(alg: FineTune, net: LiveNet, start: GlobalModel, clients: Sequence[LiveClient], *,
                 rounds: int, seed: int, fraction: float = 1.0,
                 evaluates: Callable[[int, int], bool] = lambda r, n: True, device: torch.device,
                 checkpoint: Checkpoint | None = None, resume: bool = False, progress: bool = True,
                 on_round: Callable[[FTRound], None] | None = None) -> FTRun:
    """Fine-tune for `rounds` rounds from `start`; see the module docstring."""
    M = len(clients)

    def train(r: int, ss: FTServerState) -> tuple[FTServerState, FTRound]:
        part = select_participants(M, fraction, seed, r - 1)
        ctx = RoundCtx(round=r - 1, seed=seed, participants=part, num_clients=M)
        rec = FTRound(r, part.tolist())
        down_v, down_b = alg.down_size(ss)
        sums = alg.sums_init(ss, ctx)
        for i in rec.participants:
            cl = clients[i]
            bc = alg.client_start(ss, cl.index)
            steps = -(-cl.n_train // alg.cfg.batch_size) * alg.cfg.local_epochs
            batches = tqdm(cl.train_batches(seed, r - 1, alg.cfg.batch_size, alg.cfg.local_epochs, device),
                           total=steps, desc=f"  {cl.name}", unit="batch", leave=False,
                           disable=None if progress else True)  # None: only on a terminal
            with seeded(_client_seed(seed, r - 1, cl.index)):  # dropout etc.: a function of (seed, round, client)
                msg = alg.client_update(bc, batches, cl.n_train, ctx, net, client=cl.index)
            ss = alg.client_keep(ss, cl.index, net)
            up_v, up_b = payload_size(msg, per_client=True)
            rec.up_values, rec.up_bytes = rec.up_values + up_v, rec.up_bytes + up_b
            rec.down_values, rec.down_bytes = rec.down_values + down_v, rec.down_bytes + down_b
            rec.samples += cl.n_train
            sums = alg.sums_add(sums, msg)
            del msg
        ss, _ = alg.server_finalize(ss, sums, ctx)
        rec.stats = {k: float(v) for k, v in getattr(ss, "stats", {}).items()}
        return ss, rec

    def evaluate_into(ss: FTServerState, rec: FTRound) -> dict[str, str]:
        model = (lambda i: alg.eval_model(ss, i)) if alg.personalised else ss.model
        rec.accuracy = evaluate(net, model, clients, device, alg.load)
        return {"acc": f"{100 * nanmean(rec.accuracy):.1f}"}

    return run_rounds(alg.init(start), rounds, train, evaluate_into, FTRound(0, []), device=device,
                      evaluates=evaluates, checkpoint=checkpoint, resume=resume, progress=progress,
                      desc="finetune", on_round=on_round)


def _client_seed(seed: int, round_: int, client: int) -> int:
    from fedheads.core import rng

    return int(rng.hash_keys(seed, round_, client, 0xF7))

