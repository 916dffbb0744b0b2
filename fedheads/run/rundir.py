"""Run directories are never overwritten silently (docs/contracts.md, section 6).

`train` and `compare` refuse an --out that already holds a run unless --overwrite is given; with
it, the old run's files are removed (only the names a run writes, never unknown files) once the
new run's input has been checked, so a bad option never costs the old results.

Atomic output files: write under a temporary name in the target folder, rename at the end,
so a crash never leaves a file with the final name that looks complete (docs/contracts.md)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from embedcache.errors import UserError

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


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on error it is
    removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be read by others
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_torch_save(path: str | Path, obj: Any) -> None:
    """`torch.save(obj)` to `path` atomically, streamed into the temporary file: serialising to
    memory first held a second (and, with `getvalue`, a third) copy of the tensors at peak, which
    at 1,000 clients' FedPCL state was 1 GB (benchmarks/bench_scale.py)."""
    import torch  # here, not at the top: the module serves writers that do not need torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
