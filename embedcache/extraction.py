"""Run frozen backbones once over every client's images and write the feature shards.

The plan is a list of independent chunk tasks (`embedcache.chunks.ChunkJob`: backbone, client,
split, chunk-aligned rows), each embedded in fixed batches by the functions of `embedcache.chunks`,
so a resumed, a fresh and a distributed run write bitwise-identical stores. The single-process
runner overlaps decode+preprocess (thread pool, prefetching ahead), the forward pass (this thread)
and writing (a writer thread); `embedcache.distributed` runs the same chunk functions on dask workers.

Before anything else, every image is re-fingerprinted against the manifest (cache hits
included; embedcache.sources.drift): features of an image that changed are never served.

Features of the K backbones are later concatenated by the reader (FedPCL Eq. 1-2).

Text backbones (modality "text", contract 3d) read each sample's `text` from the manifest instead
of decoding its image: the same chunks and fixed batches, tokenized in this thread (microseconds per
text), embedded, and for token backbones (`minilm-l6-v2:32@layer.5`) written with their mask.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from embedcache.chunks import ChunkJob, decode_sample, default_factory, embed_chunk, embed_text_chunk, is_text
from embedcache.devices import resolve_device
from embedcache.errors import UserError
from embedcache.plugins import import_plugins
from embedcache.progress import bar as progress_bar
from embedcache.store import writer as st
from embedcache.store.layout import other_shards, store_writes
from embedcache.store.reader import is_imported


@dataclass(frozen=True)
class ExtractConfig:
    """Settings of one `embedcache extract` run."""

    backbones: tuple[str, ...]  # backbone names, in the order given
    store: str  # store directory
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda", "cuda:N"
    batch_size: int = 64  # rows per forward pass (within a chunk)
    num_workers: int = 2  # decode+preprocess threads (per process)
    scheduler: str | None = None  # None: this process; "local:N": dask LocalCluster; "tcp://host:port"
    views: int = 1  # V; V > 1 also stores V augmented views per sample
    dtype: str = "float32"  # storage dtype (float32 default, see embedcache.store.writer.DTYPES)
    weights_dir: str | None = None  # --weights-dir, passed to create_backbone
    chunk_rows: int = st.DEFAULT_CHUNK_ROWS  # rows per zarr chunk = per task
    plugins: tuple[str, ...] = ()  # modules imported first (e.g. to register custom backbones), also on workers
    progress: bool = True  # show tqdm bars
    cut: str | None = None  # --cut BLOCK: store the map after BLOCK of every backbone (names become B@BLOCK)




@dataclass
class ExtractReport:
    """What a run did, per backbone."""

    shards: int = 0
    cache_hits: int = 0
    chunks_computed: int = 0
    rows_computed: int = 0
    seconds: float = 0.0
    per_backbone: dict[str, dict] = field(default_factory=dict)
    changed: bool = False  # some shard was (re)written
    notes: list[str] = field(default_factory=list)  # also printed on stderr as they arise

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        print(f"note: {msg}", file=sys.stderr, flush=True)












def build_specs(manifest: Any, backbone: Any, cfg: ExtractConfig) -> list[tuple[st.ShardSpec, tuple[str, ...]]]:
    """One ShardSpec per (client, split) of the manifest, with the rows' locators (image
    backbones) or texts (text backbones: a sample without a text is a one-line error)."""
    text = is_text(backbone)
    token_shape = getattr(backbone, "token_shape", None) if text else None
    if text and cfg.views > 1:
        raise UserError(f"{backbone.name}: a text backbone has no augmented views; drop --views {cfg.views} "
                        "or extract it separately")
    n_classes = len(manifest.classes)
    manifest_hash = manifest.content_hash  # a property that hashes the whole manifest: once
    out = []
    for client in manifest.clients:
        for split in st.SPLITS:
            samples = manifest.samples(client.name, split)
            for s in samples:
                if not 0 <= int(s.label) < n_classes:
                    raise UserError(f"{s.id}: label {s.label} outside the class list (0..{n_classes - 1})")
                if text and s.text is None:
                    raise UserError(f"{s.id}: no text; {backbone.name} is a text backbone and needs a paired "
                                    "manifest (every sample with a text)")
            spec = st.ShardSpec(
                backbone=backbone.name, weights_sha256=backbone.weights_sha256,
                preprocess=dict(backbone.preprocess), feature_dim=int(backbone.feature_dim),
                client=client.name, split=split, domain=client.domain,
                manifest_hash=manifest_hash,
                sample_list_hash=manifest.sample_list_hash(client.name, split),
                sample_ids=tuple(s.id for s in samples), labels=tuple(int(s.label) for s in samples),
                views=cfg.views, dtype=cfg.dtype, chunk_rows=cfg.chunk_rows, batch_size=cfg.batch_size,
                modality="text" if text else "image",
                token_shape=None if token_shape is None else (int(token_shape[0]), int(token_shape[1])))
            out.append((spec, tuple(str(s.text) if text else s.locator for s in samples)))
    return out


def _prefetch(stream: Iterator[Callable[[], Any]], pool: ThreadPoolExecutor, ahead: int) -> Iterator[Any]:
    """Run the thunks of `stream` on `pool`, at most `ahead` in flight, yielding results in order."""
    pending: deque[Future] = deque()
    for thunk in stream:
        pending.append(pool.submit(thunk))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class _Writer(threading.Thread):
    """Writes finished chunks while the next ones are decoded and embedded."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="embedcache-writer")
        self.q: queue.Queue = queue.Queue(maxsize=4)
        self.error: BaseException | None = None

    def run(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is None:
                try:
                    st.write_chunk(*item)
                except BaseException as exc:  # surfaced by put()/close() in the main thread
                    self.error = exc

    def put(self, item: tuple) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(item)

    def close(self) -> None:
        self.q.put(None)
        self.join()
        if self.error is not None:
            raise self.error


def run_local(jobs: Sequence[ChunkJob], backbone: Any, cfg: ExtractConfig, bar: Any) -> None:
    """Single process: decode in threads, embed here, write in a writer thread."""
    if not jobs:
        return
    if is_text(backbone):
        return _run_local_text(jobs, backbone, bar)
    ahead = max(2 * cfg.batch_size, 4 * cfg.num_workers)

    def thunks() -> Iterator[Callable[[], Any]]:
        for job in jobs:
            a, _ = job.spec.rows(job.chunk)
            for i, loc in enumerate(job.locators):
                sid = job.spec.sample_ids[a + i]
                yield lambda sid=sid, loc=loc, src=job.source: decode_sample(backbone, src, sid, loc, cfg.views)

    writer = _Writer()
    writer.start()
    shards: dict[str, Any] = {}
    try:
        with ThreadPoolExecutor(max(1, cfg.num_workers), thread_name_prefix="embedcache-decode") as pool:
            decoded = _prefetch(thunks(), pool, ahead)
            for job in jobs:
                items = [next(decoded) for _ in job.locators]
                feats, views = embed_chunk(backbone, items, job.spec, job.batch_size)
                path = st.shard_path(job.store, job.spec.backbone, job.spec.client, job.spec.split)
                if path not in shards:
                    shards[path] = st.open_shard(job.store, job.spec.backbone, job.spec.client, job.spec.split)
                writer.put((shards[path], job.chunk, feats, views))
                bar.update(len(items))
    finally:
        writer.close()


def _run_local_text(jobs: Sequence[ChunkJob], backbone: Any, bar: Any) -> None:
    """Text: nothing to decode; tokenize and embed here, write in the writer thread."""
    writer = _Writer()
    writer.start()
    shards: dict[str, Any] = {}
    try:
        for job in jobs:
            feats, mask = embed_text_chunk(backbone, job.texts, job.spec, job.batch_size)
            path = st.shard_path(job.store, job.spec.backbone, job.spec.client, job.spec.split)
            if path not in shards:
                shards[path] = st.open_shard(job.store, job.spec.backbone, job.spec.client, job.spec.split)
            writer.put((shards[path], job.chunk, feats, None, mask))
            bar.update(len(job.texts))
    finally:
        writer.close()




def _load_manifest(manifest: Any) -> Any:
    if isinstance(manifest, (str, Path)):
        from embedcache.manifest import load_manifest

        return load_manifest(manifest)
    return manifest


def extract(manifest: Any, cfg: ExtractConfig, *, source: Any = None,
            backbone_factory: Callable[[str, str | None, str], Any] | None = None) -> ExtractReport:
    """Extract every (backbone, client, split) shard of `manifest` into `cfg.store`.

    `source` defaults to `open_source(manifest.source)`; `backbone_factory(name, weights_dir,
    device)` defaults to `create_backbone`. First every image is fingerprinted against the
    manifest (UserError naming the changed ones); then a shard already complete with the same
    cache key is a cache hit: no image is decoded.
    """
    if cfg.views < 1:
        raise UserError(f"views {cfg.views}: must be >= 1")
    if cfg.batch_size < 1 or cfg.chunk_rows < 1:
        raise UserError(f"batch size {cfg.batch_size} / chunk rows {cfg.chunk_rows}: must be >= 1")
    if cfg.dtype not in st.DTYPES:
        raise UserError(f"dtype {cfg.dtype}: must be one of {', '.join(st.DTYPES)}")
    if not cfg.backbones:
        raise UserError("backbones: at least one is needed")
    if cfg.cut:
        from embedcache.backbones.cut import with_cut

        cfg = replace(cfg, backbones=with_cut(cfg.backbones, cfg.cut), cut=None)
    import_plugins(cfg.plugins)
    manifest = _load_manifest(manifest)
    device = str(resolve_device(cfg.device))
    t0 = time.perf_counter()  # the drift check below is part of every run's cost
    if source is None:
        from embedcache.sources import open_source

        source = open_source(manifest.source)
    from embedcache.sources.drift import check_unchanged

    report = ExtractReport()
    for msg in check_unchanged(manifest, source):
        report.note(msg)
    fresh = not (Path(cfg.store) / "zarr.json").exists()
    with store_writes(cfg.store):  # disk full, read-only: one line naming the path
        st.init_store(cfg.store, manifest.classes, manifest.content_hash, [c.name for c in manifest.clients],
                      source=manifest.source)
        try:
            with contextlib.ExitStack() as stack:
                client = _LazyClient(cfg.scheduler, stack)
                _extract_all(manifest, cfg, source, backbone_factory, device, client, report)
        except BaseException:
            # a store this run created and never got a shard into (unknown backbone, missing
            # weights...) is removed rather than left behind as an empty "store"
            if fresh and Path(cfg.store).is_dir() and not any(p.is_dir() for p in Path(cfg.store).iterdir()):
                shutil.rmtree(cfg.store, ignore_errors=True)
            raise
        if report.changed or not st.has_consolidated(cfg.store):
            st.consolidate(cfg.store)
    report.seconds = time.perf_counter() - t0
    return report


class _LazyClient:
    """Start (or connect to) the dask cluster only when there is something to compute, so a
    cache hit never pays for worker start-up."""

    def __init__(self, scheduler: str | None, stack: contextlib.ExitStack) -> None:
        self.scheduler, self.stack, self._client = scheduler, stack, None

    def get(self) -> Any:
        if self._client is None:
            from embedcache.distributed import dask_client

            self._client = self.stack.enter_context(dask_client(self.scheduler))
        return self._client


def _no_imports_beside(store: str, name: str, specs: Sequence[st.ShardSpec]) -> None:
    """Refuse to extract under a backbone name that holds imported features (other than the
    shards this run rewrites): they cannot be shown to come from this backbone's weights, and
    training would use both as one feature space (embedcache.store.reader.identity_conflict)."""
    if not specs:
        return
    for path, a in other_shards(store, st.backbone_key(name), [(s.client, s.split) for s in specs]):
        if is_imported(a.get("preprocess")):
            raise UserError(f"{name}: the store holds imported features under this name (e.g. {path}, from "
                            f"{a['preprocess']['imported_from']}); extract into another store, or `embedcache rm` them")


def _extract_all(manifest: Any, cfg: ExtractConfig, src: Any, backbone_factory: Any, device: str,
                 client: _LazyClient, report: ExtractReport) -> None:
    make = backbone_factory or default_factory
    for name in cfg.backbones:
        bb = make(name, cfg.weights_dir, device)
        specs = build_specs(manifest, bb, cfg)
        _no_imports_beside(cfg.store, name, [spec for spec, _ in specs])
        text = is_text(bb)
        jobs: list[ChunkJob] = []
        todo: list[st.ShardSpec] = []
        resumed: list[str] = []
        hits = 0
        for spec, locators in specs:
            if st.prepare_shard(cfg.store, spec):
                hits += 1
                continue
            todo.append(spec)
            shard = st.open_shard(cfg.store, spec.backbone, spec.client, spec.split)
            # Resume with the batches the shard was started with: same batches, same floats.
            batch_size = int(shard.attrs.get("batch_size", cfg.batch_size))
            if batch_size != cfg.batch_size:
                resumed.append(f"{spec.client}/{spec.split} ({batch_size})")
            for chunk in st.missing_chunks(shard):
                a, b = spec.rows(chunk)
                jobs.append(ChunkJob(store=str(cfg.store), spec=spec, chunk=chunk,
                                     locators=() if text else locators[a:b], texts=locators[a:b] if text else (),
                                     source=src, weights_dir=cfg.weights_dir, device=device,
                                     batch_size=batch_size, plugins=cfg.plugins,
                                     num_workers=cfg.num_workers, factory=backbone_factory))
        if resumed:
            report.note(f"{name}: {len(resumed)} shard(s) resumed with the batch size they were started with, "
                        f"not --batch-size {cfg.batch_size} (e.g. {resumed[0]}), so that features do not "
                        f"depend on the interruption")
        if text:
            for msg in text_notes(bb, [t for j in jobs for t in j.texts]):
                report.note(msg)
        rows = sum(j.n_rows for j in jobs)
        with progress_bar(total=rows, desc=name, unit="text" if text else "img", disable=not cfg.progress or rows == 0) as bar:
            if cfg.scheduler and jobs:
                from embedcache.distributed import run_dask

                run_dask(jobs, client.get(), bar)
            else:
                run_local(jobs, bb, cfg, bar)
        for spec in todo:
            st.finalize_shard(cfg.store, spec)
        report.changed = report.changed or bool(todo)
        report.shards += len(specs)
        report.cache_hits += hits
        report.chunks_computed += len(jobs)
        report.rows_computed += rows
        report.per_backbone[name] = {"shards": len(specs), "cache_hits": hits, "chunks": len(jobs), "rows": rows}
        del bb


def text_notes(backbone: Any, texts: Sequence[str]) -> list[str]:
    """Truncation (texts longer than T) and, for token shards, padding worth a smaller T."""
    if not texts:
        return []
    lengths = backbone.token_lengths(texts)
    t, longest = backbone.max_length, max(lengths)
    notes = []
    cut = sum(n > t for n in lengths)
    if cut:
        notes.append(f"{backbone.name}: {cut} of {len(texts)} texts are longer than T={t} tokens and were truncated "
                     f"(longest {longest} tokens, [CLS]/[SEP] included)")
    elif getattr(backbone, "token_shape", None) is not None and longest <= t // 2:
        base, cut_name = backbone.name.rsplit("@", 1)
        notes.append(f"{backbone.name}: the longest text has {longest} tokens of T={t}: rows are mostly padding; "
                     f"{base.split(':')[0]}:{longest}@{cut_name} would store {t / longest:.1f}x less")
    return notes
