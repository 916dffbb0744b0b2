"""Per-round checkpoints, shared by head training (`fedheads train/compare --resume`) and the live
stages (`fedheads finetune/feddra --resume`): one file per (run directory, seed), replaced
atomically after every round, holding tensors and plain values only (torch.load(weights_only=True)).

Every file carries the run's settings (`config`, plain JSON values) and their hash; a file
written with other settings is refused with one line naming the settings that differ, so a
resumed run can only continue the run it belongs to. Since every random choice of the engines
and drivers is a pure function of (seed, round, client, ...), continuing from a checkpoint ends
exactly where an uninterrupted run ends.

Every state file fedheads writes (these checkpoints, a run's final `state/seed<S>.pt`, a Flower
run's server state) is sealed: it carries `digest`, the sha256 of every other value in it (tensors
by name, dtype, shape and bytes; plain values as JSON), and every load checks it, as the store
checks each chunk against its digest. A file that fails is one line naming it, never used; a file
written before states carried a digest is used with a one-line note, since there is nothing to
check it against and refusing it would only strand the runs made before.

Head training's resume (`fedheads train/compare --resume`, docs/contracts.md 6):
RUN_DIR/state/seed<S>.ckpt.pt is replaced atomically after every round (save_checkpoint): the
client state (every client's rows), the server state, the next broadcast (tensor leaves in tree
order), the round records so far and the run's settings. The engines' randomness is
counter-based (fedheads/core/rng.py) and the algorithms keep no state outside these trees, so
`--resume` continues an interrupted run to exactly the numbers of an uninterrupted one. A
checkpoint of other settings (algorithm and its config, seeds, rounds, engine, layout, device,
data) is refused with one line naming what differs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from embedcache.errors import UserError
from embedcache.tensor_digest import state_dict_sha256
from fedheads.core.engine import CommRecord, RoundRecord, RunState
from fedheads.core.protocol import Init
from fedheads.run.rundir import atomic_torch_save

DIGEST = "digest"  # the key of a state file's seal
_NOTED: set[str] = set()


def _leaves(obj: Any, name: str, tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    if isinstance(obj, torch.Tensor):
        tensors[name] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _leaves(v, f"{name}/{k}", tensors, plain)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _leaves(v, f"{name}/{i}", tensors, plain)
    else:
        plain[name] = obj


def state_digest(blob: dict[str, Any]) -> str:
    """sha256 (hex) of everything in `blob` but its seal: the tensors by path, dtype, shape and
    bytes in sorted path order (`state_dict_sha256`, the backbones' weights identity), the plain
    values (rounds, history, settings, flags) as one more entry, compact JSON with sorted paths."""
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    _leaves({k: v for k, v in blob.items() if k != DIGEST}, "", tensors, plain)
    text = json.dumps(plain, sort_keys=True, separators=(",", ":"), default=repr).encode()
    tensors["\0plain"] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return state_dict_sha256(tensors)


def sealed(blob: dict[str, Any]) -> dict[str, Any]:
    """`blob` with its digest (what a state file holds: fedheads.run.rundir.RunDir.save_state)."""
    return {**blob, DIGEST: state_digest(blob)}


def save_sealed(path: Path, blob: dict[str, Any]) -> None:
    """`blob` with its digest, written atomically to `path`."""
    atomic_torch_save(path, sealed(blob))


def load_sealed(path: Path, fmt: str, remedy: str) -> dict[str, Any]:
    """The `fmt` file at `path`, its digest checked; UserError naming the file (ending in `remedy`,
    what to do) when it is unreadable, not a `fmt` file, or corrupt."""
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol warning would be a second line
            warnings.simplefilter("ignore", UserWarning)
            blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, a pickle of other objects, not a torch file at all
        raise UserError(f"{path}: not a readable {fmt} file ({type(exc).__name__}); {remedy}") from None
    if not isinstance(blob, dict) or blob.get("format") != fmt:
        raise UserError(f"{path}: not a {fmt} file; {remedy}")
    if DIGEST not in blob:
        if str(path) not in _NOTED:
            _NOTED.add(str(path))
            print(f"note: {path}: written before state files carried a digest, so it is used unchecked",
                  file=sys.stderr, flush=True)
        return blob
    if blob[DIGEST] != state_digest(blob):
        raise UserError(f"{path}: corrupt (its contents do not match the digest written with them); {remedy}")
    return blob


def config_hash(config: Any) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def config_diff(saved: dict[str, Any], now: dict[str, Any], most: int = 3) -> str:
    """'key: saved -> now' for the first `most` settings that differ (dotted keys), '' if none."""
    a, b = _flat(json.loads(json.dumps(saved, default=str))), _flat(json.loads(json.dumps(now, default=str)))
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<unset>") != b.get(k, "<unset>"))
    parts = [f"{k}: {a.get(k, '<unset>')!r} -> {b.get(k, '<unset>')!r}" for k in keys[:most]]
    return "; ".join(parts) + (f" (and {len(keys) - most} more)" if len(keys) > most else "")


def save_checkpoint(path: Path, fmt: str, config: dict[str, Any], round_: int, payload: dict[str, Any],
                    history: list[dict[str, Any]]) -> None:
    """Write `payload` (tensors, lists and dicts of them, plain values) atomically to `path`."""
    blob = {"format": fmt, "config_hash": config_hash(config), "config": json.dumps(config, sort_keys=True,
                                                                                     default=str),
            "round": int(round_), "history": history, **payload}
    save_sealed(path, blob)


def load_checkpoint(path: Path, fmt: str, config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint at `path` (UserError when it is unreadable, of another format, or written with
    other settings: the line names what differs)."""
    blob = load_sealed(path, fmt, "start the run over with --overwrite, or delete it and --resume to train only this seed again")
    if blob.get("config_hash") != config_hash(config):
        saved = blob.get("config")
        what = config_diff(json.loads(saved), config) if isinstance(saved, str) else ""
        raise UserError(f"{path}: written by a run with other settings ({what or 'settings hash differs'}); "
                        "resume with the same settings, or start over with --overwrite")
    return blob


CKPT_FORMAT = "fedheads-train-ckpt/1"


def recorded_layout(run_dir: Path) -> str | None:
    """The feature layout (padded | bucketed | streamed) the checkpoints in `run_dir` (a run or a
    comparison) were written with, from the first readable one; None when there is none. A resumed
    `--layout auto` run keeps it: auto's choice may depend on the memory available, and a
    checkpoint is only resumed with the layout and features it names."""
    for path in sorted(Path(run_dir).glob("**/state/seed*.ckpt.pt")):
        try:
            blob = load_sealed(path, CKPT_FORMAT, "")
            name = json.loads(blob["config"])["layout"]["name"]
        except (UserError, KeyError, TypeError, ValueError):
            continue  # unreadable here: the run's own resume says why, in one line
        return str(name)
    return None


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


def sized_like(like: Any, saved: list[Any], fields: tuple[str, ...] | list[str], plain: bool = False) -> Any:
    """`like` (an init's server state) with its tensor `fields` (AlgorithmBase.server_sized_fields:
    sized by the training data, e.g. FedCOF's bank of the pairs received) at the shapes of their
    `saved` leaves (tree_values order, `plain` as saved), so that `restore_tree` checks every other
    leaf's shape against the init's."""
    if not fields or not dataclasses.is_dataclass(like):
        return like
    changes, i = {}, 0
    for f in dataclasses.fields(like):
        v = getattr(like, f.name)
        if f.name in fields and isinstance(v, torch.Tensor) and i < len(saved) and isinstance(saved[i], torch.Tensor):
            changes[f.name] = v.new_empty(saved[i].shape)
        i += len(tree_values(v, plain))
    return dataclasses.replace(like, **changes)


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
    float64 checksum of every feature and label (one pass over the data, no copy); for a streamed
    federation with an identity (the store's fingerprint), that identity instead of a read of it."""
    out = {"clients": list(data.client_names), "n_train": [int(n) for n in data.n_train],
           "n_test": [int(n) for n in data.n_test], "num_classes": int(data.num_classes), "dim": int(data.dim)}
    if data.layout == "streamed" and data.identity is not None:
        return {**out, "identity": data.identity}
    xs, ys = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for _, g in data.groups():
        xs = xs + _sum64(g.x_train) + _sum64(g.x_test)
        ys = ys + _sum64(g.y_train * g.m_train) + _sum64(g.y_test * g.m_test)
    return {**out, "checksum": [float(xs), float(ys)]}


class HeadCheckpoint:
    """The engine's Checkpointer (fedheads.core.engine) for one seed of a run directory.
    `resume=False` starts afresh (and overwrites the file after round 1); `on_round` is called
    with each new round's record after its checkpoint is written (progress logging)."""

    def __init__(self, path: Path, config: dict[str, Any], algorithm: str, resume: bool,
                 on_round: Callable[[RoundRecord], None] | None = None, sized_fields: tuple[str, ...] = ()) -> None:
        self.path, self.config, self.algorithm, self.resume, self.on_round = path, config, algorithm, resume, on_round
        self.sized_fields = sized_fields  # the algorithm's server_sized_fields

    def load(self, init: Init) -> RunState | None:
        if not (self.resume and self.path.is_file()):
            return None
        blob = load_checkpoint(self.path, CKPT_FORMAT, self.config)
        history = [_record(d) for d in blob["history"]]
        if self.on_round is not None and hasattr(self.on_round, "start_from"):
            self.on_round.start_from(history)
        return RunState(int(blob["round"]),
                        restore_tree(init.client_state, blob["client"], self.path, "client", self.algorithm, True),
                        restore_tree(sized_like(init.server_state, blob["server"], self.sized_fields, True),
                                     blob["server"], self.path, "server", self.algorithm, True),
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
