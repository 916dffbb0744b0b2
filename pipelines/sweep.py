"""Run cells on dask.distributed (a LocalCluster for `local:N`, an existing scheduler for
`tcp://HOST:PORT`) or one after another in this process (`serial`, for debugging and as the
reference the distributed runs are compared with).

Each cell is one independent task (`pipelines.cells.run_cell`), keyed by its hash. A cell whose
result file exists is skipped, so a re-run does only what is missing and a killed sweep continues
where it stopped; a failed cell is recorded with its error and the others go on. One progress bar
counts done / running / failed cells. Workers must see the cache and output directories at the
same paths as the driver (true for local clusters; for remote workers, a shared file system).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from embedcache.atomic import atomic_path
from embedcache.errors import UserError
from embedcache.progress import bar as tqdm
from fedheads.run.allocator import GlibcHeap, reusing_freed_blocks, worker_env
from pipelines.cells import RESULT_FORMAT, result_path, run_cell

# Local workers keep freed large blocks for reuse inside a cell (run_cell gives them back at its
# end): a cell re-makes same-sized tensors every round. Workers of a `tcp://` scheduler keep the
# environment they were started with (the README says how to start them the same way).
WORKER_ENV = worker_env()


def parse_scheduler(spec: str | None) -> str:
    """'serial' | 'local:N' | 'tcp://HOST:PORT' (UserError otherwise); None -> local:<usable CPUs>."""
    import os

    if spec is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return f"local:{max(1, n)}"
    if spec == "serial":
        return spec
    from embedcache.distributed import local_workers

    try:
        local_workers(spec)
    except UserError:
        raise UserError(f"--scheduler {spec!r}: use serial, local:N (N >= 1) or tcp://HOST:PORT") from None
    return spec


def load_record(cells_dir: Path, h: str) -> dict[str, Any] | None:
    """The finished record of cell `h`, or its failure record, or None (not run yet)."""
    for name in (h, f"{h}.failed"):
        p = result_path(cells_dir, name)
        if p.is_file():
            try:
                rec = json.loads(p.read_text())
            except json.JSONDecodeError:
                continue  # never half-written (atomic), but a foreign file is not a result
            if rec.get("format") == RESULT_FORMAT and rec.get("hash") == h:
                return rec
    return None


def _failure(cell: dict[str, Any], cells_dir: Path, error: str) -> dict[str, Any]:
    """A failure the cell could not record itself (its worker died): written by the driver."""
    rec = {"format": RESULT_FORMAT, "hash": cell["hash"], "config": cell["config"], "labels": cell["labels"],
           "status": "failed", "error": error.splitlines()[0][:500], "timing": {"finished": time.time()}}
    with atomic_path(result_path(cells_dir, f"{cell['hash']}.failed")) as tmp:
        tmp.write_text(json.dumps(rec, indent=1, sort_keys=True, default=str))
    return rec


class _Bar:
    """One bar over every cell of the run, with done / running / failed counts."""

    def __init__(self, total: int, done: int, desc: str, enabled: bool) -> None:
        self.bar = tqdm(total=total, initial=done, desc=desc, unit="cell", disable=not enabled, dynamic_ncols=True)
        self.done, self.failed, self.running = done, 0, 0
        self._show()

    def _show(self) -> None:
        self.bar.set_postfix_str(f"done={self.done} running={self.running} failed={self.failed}", refresh=True)

    def finished(self, rec: dict[str, Any]) -> None:
        if rec["status"] == "done":
            self.done += 1
        else:
            self.failed += 1
            self.bar.write(f"failed: {rec['labels']['point']} / {rec['labels']['method']} / seed "
                           f"{rec['labels']['seed']}: {rec.get('error')}")
        self.bar.update(1)
        self._show()

    def set_running(self, n: int) -> None:
        if n != self.running:
            self.running = n
            self._show()

    def close(self) -> None:
        self.bar.close()


def run_cells(cells: Iterable[dict[str, Any]], cells_dir: str | Path, scheduler: str, *, force: bool = False,
              progress: bool = True, desc: str = "cells", client: Any = None) -> dict[str, dict[str, Any]]:
    """Run every cell that has no finished record (all of them with `force`); returns hash -> record.
    `client`: a dask Client to reuse (else one is made for `scheduler` when there is work)."""
    cells_dir = Path(cells_dir)
    cells_dir.mkdir(parents=True, exist_ok=True)
    unique = list({c["hash"]: c for c in cells}.values())
    records: dict[str, dict[str, Any]] = {}
    todo = []
    for c in unique:
        rec = None if force else load_record(cells_dir, c["hash"])
        if rec is not None and rec["status"] == "done":
            records[c["hash"]] = rec
        else:
            todo.append(c)  # never run, or failed before: failures are retried
    bar = _Bar(len(unique), len(records), desc, progress)
    try:
        if not todo:
            return records
        if scheduler == "serial":
            with reusing_freed_blocks():  # what the workers get from WORKER_ENV (fedheads/run/allocator.py)
                for c in todo:
                    bar.set_running(1)
                    rec = run_cell(c, str(cells_dir), GlibcHeap())
                    records[c["hash"]] = rec
                    bar.finished(rec)
            bar.set_running(0)
        else:
            if client is not None:
                _run_dask(todo, cells_dir, client, records, bar)
            else:
                from embedcache.distributed import dask_client

                with dask_client(scheduler, worker_env=WORKER_ENV) as new:
                    _run_dask(todo, cells_dir, new, records, bar)
    finally:
        bar.close()
    return records


def _run_dask(todo: list[dict[str, Any]], cells_dir: Path, client: Any, records: dict[str, dict[str, Any]],
              bar: _Bar) -> None:
    """One task per cell, keyed by its hash; results are taken as they come. A lost scheduler is
    one line (the cells finished so far are on disk, and a re-run skips them)."""
    from embedcache.distributed import cancel_quietly, quiet_connection_loss, scheduler_lost

    by_key = {f"cell-{c['hash']}": c for c in todo}
    address = str(getattr(client.scheduler, "address", None) or "(unknown address)")
    futures = {client.submit(run_cell, c, str(cells_dir), key=k, pure=False): k for k, c in by_key.items()}
    pending = set(futures)
    try:
        with quiet_connection_loss():
            _take_results(futures, pending, by_key, cells_dir, client, records, bar)
    except Exception as exc:  # the scheduler died or went away: one line, the finished cells stay on disk
        if isinstance(exc, UserError) or not scheduler_lost(client, exc):
            raise
        left = sum(1 for c in todo if c["hash"] not in records)
        raise UserError(f"scheduler {address}: connection lost with {left} of {len(todo)} cells unfinished; the "
                        f"finished cells are kept in {cells_dir}: start the scheduler again and re-run to do the "
                        "rest") from None
    finally:
        cancel_quietly(client, pending)


def _take_results(futures: dict[Any, str], pending: set[Any], by_key: dict[str, dict[str, Any]], cells_dir: Path,
                  client: Any, records: dict[str, dict[str, Any]], bar: _Bar) -> None:
    """Record each cell's result as it comes (a failed task is recorded as the cell's failure)."""
    from distributed import wait

    from embedcache.distributed import scheduler_lost

    last_poll = 0.0
    while pending:
        try:
            done, rest = wait(pending, timeout=1.0, return_when="FIRST_COMPLETED")
        except TimeoutError:  # nothing finished within the second: refresh the running count
            done, rest = set(), pending
        pending.intersection_update(rest)  # the caller cancels what is left
        for fut in done:
            cell = by_key[futures[fut]]
            try:
                rec = fut.result()
            except Exception as exc:  # the worker died (KilledWorker) or the task was lost
                if scheduler_lost(client, exc):
                    raise
                rec = _failure(cell, cells_dir, f"{type(exc).__name__}: {exc}")
            records[cell["hash"]] = rec
            bar.finished(rec)
        if time.monotonic() - last_poll > 1.0:  # tasks being computed right now, ours only
            last_poll = time.monotonic()
            try:
                proc = client.processing()
                bar.set_running(sum(1 for ks in proc.values() for k in ks if k in by_key))
            except Exception:  # noqa: BLE001 - a count on the bar is not worth a failed sweep
                pass
