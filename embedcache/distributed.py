"""Run extraction chunk jobs on dask.distributed workers.

`--scheduler local:N` starts a LocalCluster of N single-threaded worker processes;
`tcp://HOST:PORT` connects to a running scheduler (the workers must see the store and the
images at the same paths). Each worker builds a backbone once (module-level cache keyed by
name, weights dir and device) and writes its chunk regions itself; the driver only
finalises the shards. Chunks use the same fixed batches as the single-process runner, so the
store is bitwise identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from embedcache.chunks import ChunkJob, decode_sample, default_factory, embed_chunk, embed_text_chunk
from embedcache.errors import UserError
from embedcache.plugins import import_plugins
from embedcache.store import writer as st

_BACKBONES: dict[tuple[str, str | None, str], Any] = {}  # per worker process


def _backbone(job: ChunkJob) -> Any:
    key = (job.spec.backbone, job.weights_dir, job.device)
    if key not in _BACKBONES:
        import_plugins(job.plugins)
        make = job.factory or default_factory
        _BACKBONES[key] = make(job.spec.backbone, job.weights_dir, job.device)
    bb = _BACKBONES[key]
    if bb.weights_sha256 != job.spec.weights_sha256:
        raise UserError(f"{job.spec.backbone}: worker weights sha256 {bb.weights_sha256[:12]} differ from the "
                        f"driver's {job.spec.weights_sha256[:12]} (same --weights-dir on every worker?)")
    return bb


def run_chunk_job(job: ChunkJob) -> int:
    """Decode, embed and write one chunk on a worker. Returns the number of rows written."""
    bb = _backbone(job)
    if job.texts:  # a text backbone: nothing to decode
        feats, mask = embed_text_chunk(bb, job.texts, job.spec, job.batch_size)
        st.write_chunk(st.open_shard(job.store, job.spec.backbone, job.spec.client, job.spec.split),
                       job.chunk, feats, None, mask)
        return len(job.texts)
    a, _ = job.spec.rows(job.chunk)
    ids = job.spec.sample_ids[a:a + len(job.locators)]
    with ThreadPoolExecutor(max(1, job.num_workers)) as pool:
        items = list(pool.map(lambda r: decode_sample(bb, job.source, r[0], r[1], job.spec.views),
                              zip(ids, job.locators)))
    feats, views = embed_chunk(bb, items, job.spec, job.batch_size)
    shard = st.open_shard(job.store, job.spec.backbone, job.spec.client, job.spec.split)
    st.write_chunk(shard, job.chunk, feats, views)
    return len(items)


def local_workers(scheduler: str) -> int | None:
    """The one parser of a scheduler spec: N for `local:N` (a LocalCluster of N worker processes
    started here), None for the address of a running scheduler (`tcp://HOST:PORT`, `tls://...`);
    UserError for anything else."""
    if scheduler.startswith("local:"):
        try:
            n = int(scheduler.split(":", 1)[1])
        except ValueError:
            n = 0
        if n < 1:
            raise UserError(f"scheduler {scheduler}: want local:N with N >= 1")
        return n
    if scheduler.startswith(("tcp://", "tls://")):
        return None
    raise UserError(f"scheduler {scheduler}: want local:N or tcp://HOST:PORT")


@contextlib.contextmanager
def dask_client(scheduler: str, worker_env: dict[str, str] | None = None) -> Iterator[Any]:
    """A distributed Client for `local:N` (a LocalCluster started here, closed on exit) or
    `tcp://HOST:PORT` (an existing scheduler). `worker_env`: variables a local worker process
    starts with (dask's `distributed.nanny.pre-spawn-environ`, over its defaults; the nanny also
    sets them in this process while it spawns, so they are put back on exit); an existing
    scheduler's workers keep the environment they were started with."""
    import os

    import dask
    from distributed import Client, LocalCluster

    workers = local_workers(scheduler)
    if workers is not None:
        # Single-threaded worker processes: torch parallelism inside a worker would fight
        # with the other workers for the same cores.
        env = {**dask.config.get("distributed.nanny.pre-spawn-environ", {}), **(worker_env or {})}
        saved = {k: os.environ.get(k) for k in env}
        try:
            with dask.config.set({"distributed.nanny.pre-spawn-environ": env}), \
                    LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                                 dashboard_address=None, silence_logs=40) as cluster, Client(cluster) as client:
                yield client
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    else:
        try:
            client = Client(scheduler, timeout="30s")
        except OSError as exc:
            raise UserError(f"scheduler {scheduler}: cannot connect ({exc})") from None
        with quiet_connection_loss(), client:  # closing after a lost scheduler logs no traceback either
            yield client


def scheduler_lost(client: Any, exc: BaseException) -> bool:
    """Whether `exc` (raised while waiting on `client`'s futures) means the scheduler is gone."""
    from distributed.comm.core import CommClosedError

    return (client.status != "running"  # closed, or reconnecting after the connection dropped
            or isinstance(exc, CommClosedError) or "scheduler-connection-lost" in str(exc))


class _DropConnectionLoss(logging.Filter):
    """Drops distributed's own tracebacks about a lost scheduler connection: the caller reports
    the loss in one line (`scheduler_lost`), and the rest is noise the user cannot act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        from distributed.comm.core import CommClosedError

        return not isinstance(exc, (asyncio.CancelledError, CommClosedError, OSError))


@contextlib.contextmanager
def quiet_connection_loss() -> Iterator[None]:
    """While the block runs, distributed's client logs no traceback for a lost connection."""
    filt = _DropConnectionLoss()
    loggers = [logging.getLogger(n) for n in ("distributed.client", "distributed.utils", "distributed.core")]
    for lg in loggers:
        lg.addFilter(filt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(filt)


def cancel_quietly(client: Any, futures: Any) -> None:
    """Cancel what is left (nothing to cancel with when the scheduler is gone)."""
    if futures and client.status == "running":
        try:
            client.cancel(list(futures))
        except Exception:  # noqa: BLE001  the connection dropped meanwhile: nothing runs for us there
            pass


def run_dask(jobs: Sequence[ChunkJob], client: Any, bar: tqdm) -> None:
    """Run every job on the cluster; re-raise the first failure (a UserError stays one). A lost
    scheduler is one line: the chunks written so far stay, and a re-run computes only the rest."""
    if not jobs:
        return
    from distributed import as_completed

    futures = client.map(run_chunk_job, list(jobs), pure=False)
    done = 0
    try:
        with quiet_connection_loss():
            for fut in as_completed(futures):
                bar.update(fut.result())
                done += 1
    except Exception as exc:
        if isinstance(exc, UserError) or not scheduler_lost(client, exc):
            raise
        raise UserError(f"scheduler {_address(client)}: connection lost after {done} of {len(jobs)} chunks; "
                        "the chunks written are kept: start the scheduler again and re-run to compute the rest") from None
    finally:
        cancel_quietly(client, futures)


def _address(client: Any) -> str:
    try:
        return str(client.scheduler.address)
    except Exception:  # noqa: BLE001
        return "(unknown address)"
