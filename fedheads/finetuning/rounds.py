"""The live execution model's one round loop, its round records and its per-round checkpoint.

Fine-tuning (finetuning/driver.py) and FedDRA (alignment/driver.py) differ only in what a round
trains and how the global model is evaluated; `run_rounds` owns everything else: resume from the
checkpoint or evaluate round 0 (the starting model) and save it, then for r = first..R train
(the driver's body, timed on the wall and CPU clocks), evaluate the rounds the run's schedule names
(fedheads.core.schedule), append the record, save the checkpoint atomically and call `on_round`.

Every random choice of the drivers is a pure function of (seed, round, client, ...), so a run
killed at any point and resumed ends with the same state as an uninterrupted one. The checkpoint
(fedheads.run.checkpoint) holds tensors and plain values only (torch.load(weights_only=True)) and
carries a hash of the run configuration; a checkpoint of other settings is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from embedcache.errors import UserError
from embedcache.progress import bar as tqdm
from fedheads.algorithms.pfl_common import GlobalModel
from fedheads.core.engine import clock
from fedheads.core.tree import tree_leaves, tree_map
from fedheads.run.checkpoint import load_checkpoint, save_checkpoint

S = TypeVar("S")  # the server state: a frozen dataclass with a `model` (GlobalModel) field


@dataclass
class LiveRound:
    """What every live stage records per round (round 0: the starting model, nothing trained or
    sent); fine-tuning's FTRound and FedDRA's FDRound add their own fields. Rebuilt from
    `as_dict()` on resume."""

    round: int
    _: KW_ONLY
    train_seconds: float = 0.0
    train_cpu_seconds: float = 0.0
    eval_seconds: float = 0.0
    eval_cpu_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


R = TypeVar("R", bound=LiveRound)  # the stage's round record


@dataclass
class LiveRun:
    """A live stage's run of one seed: its round records and final server state."""

    rounds: list[Any] = field(default_factory=list)  # LiveRound subclass records, round 0 first
    state: Any = None  # the final server state
    resumed_from: int | None = None  # round of the checkpoint a resumed run started after


class Checkpoint:
    """One file per (run directory, seed), replaced atomically after every round (fedheads.run.checkpoint).

    The state is a frozen dataclass with a `model` (GlobalModel) field; its other fields (FT: the
    server optimiser state; FedDRA: lambda) are trees of tensors saved as the "opt" leaves.
    `record` is the round record type (rebuilt from its `as_dict()`); `config` the run's settings
    (a checkpoint written with other settings is refused, naming what differs)."""

    def __init__(self, path: Path, config: dict[str, Any], fmt: str, record: type) -> None:
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


def run_rounds(state: S, rounds: int, train: Callable[[int, S], tuple[S, R]], evaluate: Callable[[S, R], dict[str, str]],
               round0: R, *, device: torch.device, evaluates: Callable[[int, int], bool] = lambda r, n: True,
               checkpoint: Checkpoint | None = None,
               resume: bool = False, progress: bool = True, desc: str = "rounds",
               on_round: Callable[[R], None] | None = None) -> LiveRun:
    """Run rounds 1..`rounds` from `state` (or from the checkpoint, with `resume`); see the module
    docstring. `train(r, state)` runs round r and returns the new state and the round's record;
    `evaluate(state, rec)` evaluates the global model of `state` into `rec` and returns the
    progress bar's postfix; `round0` is the record of the starting model, evaluated and saved
    when the run does not resume; `evaluates(r, rounds)`: whether round r is evaluated (the run
    options' schedule, fedheads.run.commands.Schedule; default: every round)."""
    if rounds < 0:
        raise UserError(f"--rounds {rounds}: must be >= 0")
    out = LiveRun()
    if resume and checkpoint is not None and checkpoint.path.is_file():
        state, out.rounds = checkpoint.load(state)
        out.resumed_from = out.rounds[-1].round
    else:
        t = clock(device)
        evaluate(state, round0)
        t2 = clock(device)
        round0.eval_seconds, round0.eval_cpu_seconds = t2[0] - t[0], t2[1] - t[1]
        out.rounds.append(round0)
        if checkpoint is not None:
            checkpoint.save(state, out.rounds)
    first = out.rounds[-1].round + 1
    bar = tqdm(range(first, rounds + 1), desc=desc, unit="round", disable=not progress, initial=first - 1,
               total=rounds)
    for r in bar:
        t = clock(device)
        state, rec = train(r, state)
        t2 = clock(device)
        rec.train_seconds, rec.train_cpu_seconds = t2[0] - t[0], t2[1] - t[1]
        if evaluates(r, rounds):
            postfix = evaluate(state, rec)
            t3 = clock(device)
            rec.eval_seconds, rec.eval_cpu_seconds = t3[0] - t2[0], t3[1] - t2[1]
            bar.set_postfix(**postfix)
        out.rounds.append(rec)
        if checkpoint is not None:
            checkpoint.save(state, out.rounds)
        if on_round is not None:
            on_round(rec)
    out.state = state
    return out


def seed_timing(seed: int, run: LiveRun) -> dict[str, Any]:
    """One seed's entry of the timing block (docs/contracts.md, 6a) of a live run: the train/eval
    wall and CPU seconds its rounds record."""
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
