"""Per-round checkpoints of head training (`fedheads train/compare --resume`, docs/contracts.md 6).

RUN_DIR/state/seed<S>.ckpt.pt is replaced atomically after every round (fedheads.run.checkpoint): the
client state (every client's rows), the server state, the next broadcast (tensor leaves in tree
order), the round records so far and the run's settings. The engines' randomness is
counter-based (fedheads/core/rng.py) and the algorithms keep no state outside these trees, so
`--resume` continues an interrupted run to exactly the numbers of an uninterrupted one. A
checkpoint of other settings (algorithm and its config, seeds, rounds, engine, layout, device,
data) is refused with one line naming what differs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.core.engine import CommRecord, RoundRecord, RunState
from fedheads.core.protocol import Init
from fedheads.run.checkpoint import load_checkpoint, save_checkpoint

CKPT_FORMAT = "fedheads-train-ckpt/1"


def _walk(tree: Any, fn: Callable[[Any], Any], plain: bool) -> Any:
    """`tree` with `fn` applied to every tensor leaf (and with `plain`, to every other leaf too:
    a flag like FedPCL's `collect_only` changes between rounds and must be restored as well)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: _walk(getattr(tree, f.name), fn, plain)
                                            for f in dataclasses.fields(tree) if f.init})
    if isinstance(tree, dict):
        return type(tree)({k: _walk(v, fn, plain) for k, v in tree.items()})
    if isinstance(tree, (tuple, list)):
        return type(tree)(_walk(v, fn, plain) for v in tree)
    return fn(tree) if plain else tree


def tree_values(tree: Any, plain: bool = False) -> list[Any]:
    """The tensor leaves (cpu; with `plain` also the other leaves: bools, ints, None ...) in
    the order `restore_tree` reads them back."""
    out: list[Any] = []
    _walk(tree, lambda v: out.append(v.detach().cpu() if isinstance(v, torch.Tensor) else v), plain)
    return out


def restore_tree(like: Any, leaves: list[Any], path: Path, what: str, algorithm: str, plain: bool = False) -> Any:
    """`like`'s structure with the saved `leaves` (tree_values order) as values, each tensor checked
    for shape and put on `like`'s device and dtype."""
    it = iter(leaves)

    def take(t: Any) -> Any:
        try:
            v = next(it)
        except StopIteration:
            raise UserError(f"{path}: {what} state has too few values for {algorithm}") from None
        if isinstance(t, torch.Tensor) != isinstance(v, torch.Tensor):
            raise UserError(f"{path}: {what} state does not fit {algorithm} ({type(v).__name__} where "
                            f"{type(t).__name__} is expected)")
        if not isinstance(t, torch.Tensor):
            return v
        if v.shape != t.shape:
            raise UserError(f"{path}: {what} tensor of shape {tuple(v.shape)} where "
                            f"{algorithm} on this store expects {tuple(t.shape)}")
        return v.to(t.device, t.dtype)

    out = _walk(like, take, plain)
    if next(it, None) is not None:
        raise UserError(f"{path}: {what} state has extra values for {algorithm}")
    return out


def _record_dict(r: RoundRecord) -> dict[str, Any]:
    return {"round": r.round, "participants": list(r.participants), "comm": r.comm.__dict__.copy(),
            "accuracy": None if r.accuracy is None else {k: v.cpu() for k, v in r.accuracy.items()},
            "seconds": r.seconds, "cpu_seconds": r.cpu_seconds, "eval_seconds": r.eval_seconds,
            "eval_cpu_seconds": r.eval_cpu_seconds}


def _record(d: dict[str, Any]) -> RoundRecord:
    return RoundRecord(**{**d, "participants": tuple(d["participants"]), "comm": CommRecord(**d["comm"])})


def _sum64(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """float64 sum of `t` (on the host) in chunks of `chunk` elements: `t.sum(dtype=float64)`
    makes a float64 copy of its whole input first, which at 1,000 clients put ~0.04x the feature
    bytes on FedNCM's peak memory (benchmarks/bench_scale.py)."""
    parts = [c.sum(dtype=torch.float64) for c in t.reshape(-1).split(chunk)]
    return (torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=t.device)).cpu()


def data_settings(data: Any) -> dict[str, Any]:
    """What identifies the features a run trained on: clients, sizes, classes, dimension and a
    float64 checksum of every feature and label (one pass over the data, no copy)."""
    xs, ys = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for _, g in data.groups():
        xs = xs + _sum64(g.x_train) + _sum64(g.x_test)
        ys = ys + _sum64(g.y_train * g.m_train) + _sum64(g.y_test * g.m_test)
    return {"clients": list(data.client_names), "n_train": [int(n) for n in data.n_train],
            "n_test": [int(n) for n in data.n_test], "num_classes": int(data.num_classes), "dim": int(data.dim),
            "checksum": [float(xs), float(ys)]}


class HeadCheckpoint:
    """The engine's Checkpointer (fedheads.core.engine) for one seed of a run directory.
    `resume=False` starts afresh (and overwrites the file after round 1); `on_round` is called
    with each new round's record after its checkpoint is written (progress logging)."""

    def __init__(self, path: Path, config: dict[str, Any], algorithm: str, resume: bool,
                 on_round: Callable[[RoundRecord], None] | None = None) -> None:
        self.path, self.config, self.algorithm, self.resume, self.on_round = path, config, algorithm, resume, on_round

    def load(self, init: Init) -> RunState | None:
        if not (self.resume and self.path.is_file()):
            return None
        blob = load_checkpoint(self.path, CKPT_FORMAT, self.config)
        history = [_record(d) for d in blob["history"]]
        if self.on_round is not None and hasattr(self.on_round, "start_from"):
            self.on_round.start_from(history)
        return RunState(int(blob["round"]),
                        restore_tree(init.client_state, blob["client"], self.path, "client", self.algorithm, True),
                        restore_tree(init.server_state, blob["server"], self.path, "server", self.algorithm, True),
                        restore_tree(init.broadcast, blob["broadcast"], self.path, "broadcast", self.algorithm, True),
                        history, int(blob["upload_values_per_client"]))

    def save(self, state: RunState) -> None:
        save_checkpoint(self.path, CKPT_FORMAT, self.config, state.round,
                        {"client": tree_values(state.client_state, True), "server": tree_values(state.server_state, True),
                         "broadcast": tree_values(state.broadcast, True),
                         "upload_values_per_client": int(state.upload_values_per_client)},
                        [_record_dict(r) for r in state.history])
        if self.on_round is not None:
            self.on_round(state.history[-1])
