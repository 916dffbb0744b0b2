"""The fine-tuning driver: rounds over live clients with ONE network on the device.

Per round r = 1..R: the participants (fedheads.core.engine.select_participants, the head
engines' seeded choice) each load the broadcast into the one workspace network, train locally
(FineTune.client_update) and have their message added to the server's running sums right away,
so memory holds one model, the global state and the sums, never a model per client; then
FineTune.server_finalize. Round 0 is the evaluation of the starting model (pre-trained stages +
stage-1 head) before any fine-tuning.

After EVERY round a checkpoint (tensors and plain values only: torch.load(weights_only=True))
is written atomically; `resume=True` continues from it and, since every random choice is a pure
function of (seed, round, client, ...), a run killed at any point ends with the same weights as
an uninterrupted one. The checkpoint carries a hash of the run configuration and is refused when
the configuration differs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from embedcache.errors import UserError
from fedheads.algorithms.pfl_common import GlobalModel
from fedheads.core.engine import select_participants
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import payload_size, tree_leaves, tree_map
from fedheads.finetuning.algorithm import FineTune
from fedheads.finetuning.data import LiveClient, seeded
from fedheads.finetuning.model import LiveNet
from fedheads.run.checkpoint import load_checkpoint, save_checkpoint

CKPT_FORMAT = "fedheads-finetune-ckpt/1"


@dataclass
class LiveRound:
    """What every live stage records per round (round 0: the starting model, nothing trained or
    sent); FTRound and FedDRA's FDRound add their own fields. Rebuilt from `as_dict()` on resume."""

    round: int
    _: KW_ONLY
    train_seconds: float = 0.0
    train_cpu_seconds: float = 0.0
    eval_seconds: float = 0.0
    eval_cpu_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LiveRun:
    """A live stage's run of one seed: its round records and final server state."""

    rounds: list[Any] = field(default_factory=list)  # LiveRound subclass records, round 0 first
    state: Any = None  # the final server state
    resumed_from: int | None = None  # round of the checkpoint a resumed run started after


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


FTRun = LiveRun  # fine-tuning's run: rounds are FTRounds, state an FTServerState


@torch.no_grad()
def evaluate(net: LiveNet, model: GlobalModel, clients: Sequence[LiveClient], device: torch.device) -> list[float]:
    """Accuracy of the global model on each client's test split (NaN for an empty split)."""
    net.load_trained_state({**model.params, **model.buffers})
    net.eval()
    out = []
    for c in clients:
        hit, n = 0, 0
        for x, y in c.test_batches(device):
            hit += int((net(x).argmax(-1) == y).sum())
            n += int(y.numel())
        out.append(hit / n if n else math.nan)
    return out


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Checkpoint:
    """One file per (run directory, seed), replaced atomically after every round (fedheads.run.checkpoint).

    The state is a frozen dataclass with a `model` (GlobalModel) field; its other fields (FT: the
    server optimiser state; FedDRA: lambda) are trees of tensors saved as the "opt" leaves.
    `record` is the round record type (rebuilt from its `as_dict()`); `config` the run's settings
    (a checkpoint written with other settings is refused, naming what differs)."""

    def __init__(self, path: Path, config: dict[str, Any], fmt: str = CKPT_FORMAT, record: type = FTRound) -> None:
        self.path, self.config, self.fmt, self.record = path, config, fmt, record

    @staticmethod
    def _rest(state: Any) -> tuple:
        return tuple(getattr(state, f.name) for f in fields(state) if f.name != "model")

    def save(self, state: Any, rounds: list[Any]) -> None:
        save_checkpoint(self.path, self.fmt, self.config, rounds[-1].round, {
            "params": {k: v.detach().cpu() for k, v in state.model.params.items()},
            "buffers": {k: v.detach().cpu() for k, v in state.model.buffers.items()},
            "opt": [t.detach().cpu() for t in tree_leaves(self._rest(state))]}, [r.as_dict() for r in rounds])

    def load(self, like: Any) -> tuple[Any, list[Any]]:
        blob = load_checkpoint(self.path, self.fmt, self.config)
        dev = next(iter(like.model.params.values())).device

        def fill(src: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if set(src) != set(ref) or any(src[k].shape != ref[k].shape for k in ref):
                raise UserError(f"{self.path}: the checkpoint does not fit this network")
            return {k: src[k].to(dev) for k in ref}

        it = iter(blob["opt"])
        rest = tree_map(lambda t: next(it).to(t.device), self._rest(like))
        model = GlobalModel(fill(blob["params"], like.model.params), fill(blob["buffers"], like.model.buffers))
        names = [f.name for f in fields(like) if f.name != "model"]
        return replace(like, model=model, **dict(zip(names, rest))), [self.record(**r) for r in blob["history"]]


def run_finetune(alg: FineTune, net: LiveNet, start: GlobalModel, clients: Sequence[LiveClient], *,
                 rounds: int, seed: int, fraction: float = 1.0, eval_every: int = 1,
                 device: torch.device, checkpoint: Checkpoint | None = None, resume: bool = False,
                 progress: bool = True, on_round: Callable[[FTRound], None] | None = None) -> FTRun:
    """Fine-tune for `rounds` rounds from `start`; see the module docstring."""
    if rounds < 0:
        raise UserError(f"--rounds {rounds}: must be >= 0")
    if eval_every < 0:
        raise UserError(f"--eval-every {eval_every}: must be >= 0 (0 = only round 0 and the last)")
    M = len(clients)
    ss = alg.init(start)
    out = FTRun()
    if resume and checkpoint is not None and checkpoint.path.is_file():
        ss, out.rounds = checkpoint.load(ss)
        out.resumed_from = out.rounds[-1].round
    else:
        t, c = _clock()
        acc = evaluate(net, ss.model, clients, device)
        _sync(device)
        t2, c2 = _clock()
        out.rounds.append(FTRound(0, [], accuracy=acc, eval_seconds=t2 - t, eval_cpu_seconds=c2 - c))
        if checkpoint is not None:
            checkpoint.save(ss, out.rounds)
    first = out.rounds[-1].round + 1
    bar = tqdm(range(first, rounds + 1), desc="finetune", unit="round", disable=not progress,
               initial=first - 1, total=rounds)
    for r in bar:
        part = select_participants(M, fraction, seed, r - 1)
        ctx = RoundCtx(round=r - 1, seed=seed, participants=part, num_clients=M)
        rec = FTRound(r, part.tolist())
        t, c = _clock()
        bc = ss.model
        down_v, down_b = payload_size(bc, per_client=False)
        sums = alg.sums_init(ss)
        for i in rec.participants:
            cl = clients[i]
            steps = -(-cl.n_train // alg.cfg.batch_size) * alg.cfg.local_epochs
            batches = tqdm(cl.train_batches(seed, r - 1, alg.cfg.batch_size, alg.cfg.local_epochs, device),
                           total=steps, desc=f"  {cl.name}", unit="batch", leave=False,
                           disable=None if progress else True)  # None: only on a terminal
            with seeded(_client_seed(seed, r - 1, cl.index)):  # dropout etc.: a function of (seed, round, client)
                msg = alg.client_update(bc, batches, cl.n_train, ctx, net)
            up_v, up_b = payload_size(msg, per_client=True)
            rec.up_values, rec.up_bytes = rec.up_values + up_v, rec.up_bytes + up_b
            rec.down_values, rec.down_bytes = rec.down_values + down_v, rec.down_bytes + down_b
            rec.samples += cl.n_train
            sums = alg.sums_add(sums, msg)
            del msg
        ss, bc = alg.server_finalize(ss, sums, ctx)
        _sync(device)
        t2, c2 = _clock()
        rec.train_seconds, rec.train_cpu_seconds = t2 - t, c2 - c
        if r == rounds or (eval_every and r % eval_every == 0):
            rec.accuracy = evaluate(net, ss.model, clients, device)
            _sync(device)
            t3, c3 = _clock()
            rec.eval_seconds, rec.eval_cpu_seconds = t3 - t2, c3 - c2
            bar.set_postfix(acc=f"{100 * _nanmean(rec.accuracy):.1f}")
        out.rounds.append(rec)
        if checkpoint is not None:
            checkpoint.save(ss, out.rounds)
        if on_round is not None:
            on_round(rec)
    out.state = ss
    return out


def _client_seed(seed: int, round_: int, client: int) -> int:
    from fedheads.core import rng

    return int(rng.hash_keys(seed, round_, client, 0xF7))


def _nanmean(v: Sequence[float]) -> float:
    vals = [x for x in v if x == x]
    return sum(vals) / len(vals) if vals else math.nan


def seed_timing(seed: int, run: Any) -> dict[str, Any]:
    """One seed's entry of the timing block (docs/contracts.md, 6a) of a run whose rounds record
    train/eval wall and CPU seconds (fine-tuning's FTRun, FedDRA's FDRun)."""
    ft = run.rounds[1:]
    tot = {k: sum(getattr(r, k) for r in run.rounds) for k in
           ("train_seconds", "train_cpu_seconds", "eval_seconds", "eval_cpu_seconds")}
    return {"seed": seed, "wall_seconds": tot["train_seconds"] + tot["eval_seconds"],
            "cpu_seconds": tot["train_cpu_seconds"] + tot["eval_cpu_seconds"],
            "train_wall_seconds": tot["train_seconds"], "train_cpu_seconds": tot["train_cpu_seconds"],
            "eval_wall_seconds": tot["eval_seconds"], "eval_cpu_seconds": tot["eval_cpu_seconds"],
            "rounds": {"train_wall_seconds": [r.train_seconds for r in ft],
                       "train_cpu_seconds": [r.train_cpu_seconds for r in ft],
                       "eval_wall_seconds": [r.eval_seconds for r in ft],
                       "eval_cpu_seconds": [r.eval_cpu_seconds for r in ft]},
            "resumed_from_round": run.resumed_from}
