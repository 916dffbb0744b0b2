"""Run directories (docs/contracts.md, section 6): `RunDir`, the one writer of the run directories
of `train`, `compare`, `finetune`, `feddra` and Flower runs.

Never overwritten silently: an --out that already holds a run is refused unless --overwrite (or
--resume) is given; with --overwrite, the old run's files are removed (only the names a run
writes, never unknown files) once the new run's input has been checked, so a bad option never
costs the old results.

Atomic output files: write under a temporary name in the target folder, rename at the end,
so a crash never leaves a file with the final name that looks complete. results.json is written
last: its presence means the directory is complete."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import inspect
import io
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from embedcache.atomic import atomic_path
from embedcache.errors import UserError
from fedheads.report import strict_json

MARKERS = ("results.json", "config.json", "state")  # any of them: the directory holds a run
RUN_FILES = ("results.json", "config.json", "config.yaml", "metrics.csv", "summary.md", "report.md",
             "accuracy_per_round.png", "per_client.png", "figure1.png",
             "retrieval_per_round.png", "retrieval_per_client.png", "lambda.png")  # the last three: fedheads feddra


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _comparison_members(d: Path) -> list[str]:
    """Algorithm sub-directories of a comparison written into `d` (from its results.json)."""
    algs = _read_json(d / "results.json").get("algorithms")
    return [a for a in algs if isinstance(a, str) and a and "/" not in a and a not in (".", "..")] \
        if isinstance(algs, dict) else []


def describe_run(d: Path) -> str | None:
    """What `d` holds, e.g. "a fedpcl run (results.json, state/)", or None when it holds no run.
    A path that exists but is not a directory is an error."""
    if d.exists() and not d.is_dir():
        raise UserError(f"{d}: is a file, not a directory; --out needs a directory")
    found = [m + ("/" if m == "state" else "") for m in MARKERS if (d / m).exists()]
    if not found:
        return None
    res = _read_json(d / "results.json")
    if isinstance(res.get("algorithms"), dict):
        kind = f"a comparison of {', '.join(res['algorithms'])}"
    else:
        alg = res.get("algorithm") or _read_json(d / "config.json").get("algorithm")
        kind = f"a {alg} run" if isinstance(alg, str) else "a run"
    return f"{kind} ({', '.join(found)})"


def refuse_existing(out: Path, subdirs: Iterable[str] = (), overwrite: bool = False) -> None:
    """UserError when `out` (or one of the `subdirs` a comparison would write) holds a run and
    `overwrite` is off; a path that is a file is refused either way."""
    for d in [out, *(out / s for s in subdirs)]:
        what = describe_run(d)
        if what is not None and not overwrite:
            if not (d / "results.json").exists() and any((d / "state").glob("seed*.ckpt.pt")):
                raise UserError(f"{d} holds an interrupted run ({what}); use --resume to continue it, "
                                "--overwrite to replace it, or another --out")
            raise UserError(f"{d} holds {what}; use --overwrite or another --out")


def clear_run(out: Path, subdirs: Iterable[str] = ()) -> None:
    """Remove the files a run or comparison wrote in `out` and in `subdirs` (and in the
    sub-directories an earlier comparison there recorded); anything else stays."""
    dirs = [out]
    for s in [*_comparison_members(out), *subdirs]:
        if out / s not in dirs:
            dirs.append(out / s)
    for d in dirs:
        if not d.is_dir():
            continue
        for name in RUN_FILES:
            p = d / name
            if p.is_file() or p.is_symlink():
                p.unlink()
        for sub, pattern in (("state", "seed*.pt"), ("encoders", "*-seed*.pt"),  # encoders/: fedheads feddra
                             ("tensorboard", "seed*/events.out.tfevents.*")):  # fedheads train --tensorboard
            folder = d / sub
            if folder.is_dir():
                for f in folder.glob(pattern):
                    f.unlink()
                for sd in folder.glob("seed*"):
                    if sd.is_dir() and not any(sd.iterdir()):
                        sd.rmdir()
                if not any(folder.iterdir()):
                    folder.rmdir()


def check_resume(out: Path, subdirs: Sequence[str], overwrite: bool, resume: bool) -> None:
    """--resume continues the run in `out` (any state it holds is checked against the settings
    later, per seed); without it or --overwrite, a run there is refused (refuse_existing). A run
    without checkpoints is never resumed over: it would be replaced without a word."""
    if resume and overwrite:
        raise UserError("--resume and --overwrite: give one (continue the run in --out, or replace it)")
    for d in [out, *(out / s for s in subdirs)] if resume else []:
        what = describe_run(d)
        ckpts = [*d.glob("state/seed*.ckpt.pt"), *(d.glob("*/state/seed*.ckpt.pt") if d == out and subdirs else [])]
        if what is not None and not ckpts:  # e.g. a run written before checkpoints existed
            raise UserError(f"{d} holds {what} without checkpoints: nothing to resume; use --overwrite or another --out")
    refuse_existing(out, subdirs, overwrite=overwrite or resume)


LOCK = ".fedheads.lock"  # held by the run writing the directory; holds its PID


def _holder(fd: int, wait: float = 2.0) -> str:
    """The PID in the lock file open as `fd` (the file that refused us, not whatever is at its path
    by now; its holder writes it right after locking: waited for briefly)."""
    deadline = time.monotonic() + wait
    while True:
        with contextlib.suppress(OSError):
            pid = os.pread(fd, 64, 0).decode(errors="replace").strip()
            if pid:
                return pid
        if time.monotonic() > deadline:
            return "unknown"
        time.sleep(0.05)


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on run directory `out` (created if absent) while a run writes it: a
    second run into the same directory is refused in one line naming the holder's PID, instead of
    both finishing and one run's files replacing the other's. An flock is released by the kernel
    when its holder exits, however it dies, so a killed run never leaves the directory locked.
    The lock file is removed on release (and `out` too, when this call created it and it stayed
    empty)."""
    import fcntl

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: is a file, not a directory; --out needs a directory")
    top = out  # the topmost directory this call creates (removed again if it stays empty)
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    created = not out.exists()
    path = out / LOCK
    for attempt in itertools.count():
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError as exc:  # the run before removed the directory it created, just now: again
            if attempt < 20:
                continue
            raise UserError(f"{out}: cannot create the run directory ({exc.strerror or exc}); choose another "
                            "--out") from None
        except OSError as exc:
            raise UserError(f"{out}: cannot write the run directory ({exc.strerror or exc}); choose a writable "
                            "--out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            raise UserError(f"{out}: another run is writing this directory (PID {pid}); wait for it "
                            "or use another --out") from None
        try:  # the last holder removes the file on release: lock the file that is at the path now
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        path.unlink(missing_ok=True)  # still locked: no other run holds this file meanwhile
        os.close(fd)
        if created:
            with contextlib.suppress(OSError):  # only when empty: a refused run leaves nothing behind
                for d in [out, *out.parents]:
                    d.rmdir()
                    if d == top:
                        break


F = TypeVar("F", bound=Callable[..., Any])


def holds_lock(fn: F) -> F:
    """Run `fn` holding the lock (`locked`) on its `out` argument, refusals included: a run
    checks what the directory holds under the lock, so two runs cannot both find it empty."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> Any:
        with locked(Path(sig.bind(*args, **kw).arguments["out"])):
            return fn(*args, **kw)

    return wrapper  # type: ignore[return-value]


def atomic_torch_save(path: str | Path, obj: Any) -> None:
    """`torch.save(obj)` to `path` atomically, streamed into the temporary file: serialising to
    memory first held a second (and, with `getvalue`, a third) copy of the tensors at peak, which
    at 1,000 clients' FedPCL state was 1 GB (benchmarks/bench_scale.py)."""
    import torch  # here, not at the top: the module serves writers that do not need torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def config_dict(obj: Any) -> Any:
    """A dataclass (or list of them) as config.json records it: fields by name, anything that is
    not a JSON scalar as its repr (`train`, `compare`, Flower runs)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: config_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [config_dict(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)


def jsonable(obj: Any) -> Any:
    """Dataclasses (dataclasses.asdict), lists and dicts as JSON values, anything else as it is
    (`finetune`, `feddra` config.json)."""
    if hasattr(obj, "__dataclass_fields__"):
        return {k: jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    return obj


class RunDir:
    """One run directory being written, and the only writer of its files.

    Opening: `check` (refusals, nothing touched) once the options are known, then `begin` once
    the run's input has been checked (--overwrite: the old run's files removed; results.json
    removed in any case, so a resumed run is complete again only when it finishes). Writing:
    every file atomically (write_text, write_json, write_csv, save_state, save_figure), then
    `finish`, which writes results.json last; nothing may be written after it. `members`: the
    sub-directories of a comparison (one RunDir each, `member`). The lock (`locked`, `holds_lock`)
    is held by the caller around all of it."""

    def __init__(self, path: str | Path, members: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.members = tuple(members)
        self.finished = False

    def _dirs(self) -> list[Path]:
        return [self.path, *(self.path / m for m in self.members)]

    def member(self, name: str) -> RunDir:
        """The run directory of comparison member `name`."""
        return RunDir(self.path / name)

    def check(self, overwrite: bool, resume: bool, *, resume_needs_checkpoints: bool = True) -> None:
        """Refuse (UserError) a directory that holds a run, unless `overwrite` or `resume`.
        `resume_needs_checkpoints` (train, compare: check_resume): --resume and --overwrite are
        exclusive and a run without checkpoints is not resumed over. Without it (finetune, feddra:
        their drivers check the checkpoint), --resume wins over --overwrite."""
        if resume_needs_checkpoints:
            check_resume(self.path, self.members, overwrite, resume)
            return
        for d in self._dirs():
            what = describe_run(d)
            if what is not None and not (overwrite or resume):
                raise UserError(f"{d} holds {what}; use --resume to continue it, --overwrite to replace it, "
                                "or another --out")

    def begin(self, overwrite: bool) -> RunDir:
        """Start writing: with `overwrite`, remove the files an earlier run wrote here (clear_run);
        remove results.json in any case (it marks a complete directory). Returns self."""
        if overwrite:
            clear_run(self.path, self.members)
        for d in self._dirs():
            (d / "results.json").unlink(missing_ok=True)
        return self

    def file(self, name: str) -> Path:
        """The path of file `name`, for a writer with its own atomic file format (`ckpt:` exports,
        per-round checkpoints: fedheads.run.checkpoint)."""
        self._writable(name)
        return self.path / name

    def _writable(self, name: str) -> None:
        if self.finished:
            raise RuntimeError(f"{self.path}: {name} written after results.json (RunDir.finish must come last)")

    def write_text(self, name: str, text: str) -> Path:
        """File `name` holding `text` (UTF-8), atomically."""
        self._writable(name)
        with atomic_path(self.path / name) as tmp:
            tmp.write_bytes(text.encode())
        return self.path / name

    def write_json(self, name: str, obj: Any) -> Path:
        """`obj` as indented JSON with sorted keys and a final newline (config.json)."""
        return self.write_text(name, json.dumps(obj, indent=2, sort_keys=True) + "\n")

    def write_csv(self, name: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
        """A CSV file: `header`, then `rows` (newline line ends)."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
        return self.write_text(name, buf.getvalue())

    def save_state(self, name: str, obj: Any) -> Path:
        """`torch.save(obj)` atomically (states and checkpoints: fedheads.run.checkpoint.sealed)."""
        self._writable(name)
        atomic_torch_save(self.path / name, obj)
        return self.path / name

    def save_figure(self, name: str, draw: Callable[[Path], Any]) -> Path:
        """A plot: `draw(path)` draws and saves it at `path` (the fedheads.report.plotting functions,
        which write atomically through `atomic_path`)."""
        self._writable(name)
        path = self.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        draw(path)
        return path

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """results.json (indented, sorted keys, strict, as fedheads.report.results.write_results_json),
        written last: from now on the directory is complete and nothing more is written. Returns
        `result`."""
        self._writable("results.json")
        with atomic_path(self.path / "results.json") as tmp:
            tmp.write_bytes(strict_json.dumps(result).encode())  # strict JSON: an infinite epsilon is null
        self.finished = True
        return result
