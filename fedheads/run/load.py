"""Loading a federation (fedheads.core.federation) from a feature store or from arrays: the only
fedheads module that reads the store's zarr arrays.

`load_fed_data` reads the feature store (contract 4 in docs/contracts.md; features of several
backbones are concatenated, FedPCL Eq. 1-2) chunk by chunk straight into the padded tensors (or
into each client's bucket): the padding is the only memory beyond the features themselves
(benchmarks/bench_memory.py, benchmarks/bench_scale.py). `from_arrays` builds one from in-memory
arrays, through the same writer."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.core.federation import (
    BucketedFedData,
    FedData,
    Federation,
    LayoutConfig,
    StreamedFedData,
    as_layout,
    plan_buckets,
    plan_shapes,
    without_train,
)

if TYPE_CHECKING:
    from embedcache.store.reader import StoreInfo


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda when available else cpu; unknown or unavailable devices -> UserError
    (the one parser: embedcache.devices.resolve_device)."""
    from embedcache.devices import resolve_device as parse_device  # torch only

    return parse_device(device)


def from_arrays(clients: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
                num_classes: int, client_names: Sequence[str] | None = None,
                domains: Sequence[str] | None = None, device: str | torch.device = "cpu",
                binarize: bool = False, train_views: Sequence[np.ndarray] | None = None,
                layout: str | LayoutConfig = "padded") -> Federation:
    """Stack per-client (x_train, y_train, x_test, y_test) numpy arrays (and optionally each
    client's augmented train views [V, N, D], same V for all clients). The default layout
    gives a FedData; `layout` "bucketed" / "auto" may give a BucketedFedData, "streamed" a
    StreamedFedData that copies each bucket out of `clients` when it is read (fedheads.core.federation).

    `binarize` reproduces the FedPCL code's L2-normalisation over a size-1 axis, which maps
    every feature to 0/1 (= x > 0 for non-negative pooled features; sign(x) in general)."""
    dev = resolve_device(device)
    M = len(clients)
    if M == 0:
        raise UserError("clients: empty federation")
    names = tuple(client_names) if client_names is not None else tuple(f"c{i:03d}" for i in range(M))
    doms = tuple(domains) if domains is not None else tuple("" for _ in range(M))
    if len(names) != M or len(doms) != M:
        raise UserError(f"client_names/domains: expected {M} entries")
    dims = {np.asarray(c[0]).shape[-1] for c in clients} | {np.asarray(c[2]).shape[-1] for c in clients if len(c[2])}
    if len(dims) != 1:
        raise UserError(f"features: dimension differs across clients {sorted(dims)}")
    D = dims.pop()
    ntr, nte = [], []
    for name, (xtr, ytr, xte, yte) in zip(names, clients):
        for split, x, y in (("train", xtr, ytr), ("test", xte, yte)):
            x, y = np.asarray(x), np.asarray(y)
            if x.ndim != 2 or y.shape != (x.shape[0],):
                raise UserError(f"{name}/{split}: features must be [N, D] with N labels, got {x.shape} / {y.shape}")
            if x.size and not np.isfinite(x).all():
                raise UserError(f"{name}/{split}: features contain NaN or inf")
            _check_labels(y, num_classes, f"{name}/{split}")
        if len(ytr) == 0:
            raise UserError(f"{name}: no training samples")
        ntr.append(len(ytr))
        nte.append(len(yte))
    vs = None
    if train_views is not None:
        vs = [np.asarray(v) for v in train_views]
        if len(vs) != M or len({v.shape[0] for v in vs}) != 1:
            raise UserError("train_views: need one [V, N, D] array per client with the same V")
        for name, v, n in zip(names, vs, ntr):
            if v.shape[1:] != (n, D) or not np.isfinite(v).all():
                raise UserError(f"{name}/train views: expected finite [V, {n}, {D}], got {v.shape}")
    cfg = as_layout(layout)
    if cfg.layout == "streamed":
        if vs is not None:
            raise UserError("layout streamed: stored augmented views are not streamed; use layout bucketed")
        plan = plan_buckets(ntr, nte, 4 * D, cfg)

        def read_bucket(b: int, train: bool) -> FedData:  # the bucket's rows copied out of the caller's arrays
            part = from_arrays([clients[i] for i in plan[b]], num_classes, [names[i] for i in plan[b]],
                               [doms[i] for i in plan[b]], dev, binarize)
            assert isinstance(part, FedData)
            part = dataclasses.replace(part, client_index=torch.tensor(plan[b], dtype=torch.int64, device=dev))
            return without_train(part, train)

        return StreamedFedData(read_bucket, tuple(plan), plan_shapes(plan, ntr, nte), tuple(ntr), tuple(nte),
                               int(num_classes), names, doms, D, dev)
    build = _Builder(ntr, nte, D, dev, cfg, views=None if vs is None else vs[0].shape[0])
    for i, (xtr, ytr, xte, yte) in enumerate(clients):
        build.put("train", i, 0, np.asarray(xtr), np.asarray(ytr))
        build.put("test", i, 0, np.asarray(xte), np.asarray(yte))
        if vs is not None:
            build.put_views(i, vs[i])
    return build.finish(ntr, nte, num_classes, names, doms, binarize)  # type: ignore[return-value]


def _check_labels(y: np.ndarray, num_classes: int, where: str) -> None:
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise UserError(f"{where}: label out of range 0..{num_classes - 1}")


class _Stacker:
    """Zero-padded [M, Nmax, D] float32 features and [M, Nmax] int64 labels, allocated once on
    the target device and filled in place chunk by chunk: nothing larger than one chunk is held
    besides the result (no per-client arrays kept for the whole federation, no concatenated or
    host-side copy of the whole). On CUDA the rows go through two pinned staging buffers with
    non_blocking copies, so reading the next chunk overlaps the transfer of the previous one."""

    def __init__(self, M: int, nmax: int, dim: int, device: torch.device) -> None:
        self.x = torch.zeros((M, nmax, dim), dtype=torch.float32, device=device)
        self.y = torch.zeros((M, nmax), dtype=torch.int64)  # small: built on the host, moved once
        self.cuda = device.type == "cuda"
        self.stage: list[torch.Tensor] = []
        self.events: list[Any] = [None, None]
        self.k = 0

    def put(self, i: int, row0: int, x: np.ndarray, y: np.ndarray) -> None:
        """Rows row0.. of client i (x [n, D] float32-convertible, y [n])."""
        n = len(y)
        if n == 0:
            return
        self.y[i, row0:row0 + n] = torch.from_numpy(np.asarray(y, dtype=np.int64))
        src = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        dst = self.x[i, row0:row0 + n]
        if not self.cuda:
            dst.copy_(src)
            return
        k, self.k = self.k, self.k ^ 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # its previous copy has left the staging buffer
        if not self.stage or self.stage[k].numel() < src.numel():
            self.stage = [torch.empty(src.numel(), dtype=torch.float32, pin_memory=True) for _ in range(2)]
            self.events = [None, None]
        buf = self.stage[k][: src.numel()].view(src.shape)
        buf.copy_(src)
        dst.copy_(buf, non_blocking=True)
        self.events[k] = torch.cuda.Event()
        self.events[k].record()

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cuda:
            torch.cuda.current_stream(self.x.device).synchronize()  # staging buffers are freed next
        return self.x, self.y.to(self.x.device)


class _Builder:
    """The layout's tensors for clients of known sizes: per bucket (layout.plan_buckets) one pair
    of _Stackers, filled client by client, chunk by chunk, then assembled into a Federation."""

    def __init__(self, ntr: Sequence[int], nte: Sequence[int], dim: int, device: torch.device,
                 layout: LayoutConfig, views: int | None = None) -> None:
        self.plan = plan_buckets(ntr, nte, 4 * dim, layout)
        self.where = {i: (b, p) for b, members in enumerate(self.plan) for p, i in enumerate(members)}
        self.stacks = [{"train": _Stacker(len(ms), max(ntr[i] for i in ms), dim, device),
                        "test": _Stacker(len(ms), max(max(nte[i] for i in ms), 1), dim, device)} for ms in self.plan]
        self.views = None if views is None else [
            torch.zeros((len(ms), views, max(ntr[i] for i in ms), dim), dtype=torch.float32, device=device)
            for ms in self.plan]

    def capacity(self, split: str, i: int) -> int:
        """Rows client i's slot holds (its bucket's largest client)."""
        b, _ = self.where[i]
        return int(self.stacks[b][split].x.shape[1])

    def put(self, split: str, i: int, row0: int, x: np.ndarray, y: np.ndarray) -> None:
        b, p = self.where[i]
        self.stacks[b][split].put(p, row0, x, y)

    def put_views(self, i: int, v: np.ndarray) -> None:
        b, p = self.where[i]
        self.views[b][p, :, : v.shape[1]] = torch.as_tensor(v).to(self.views[b].device)  # type: ignore[index]

    def finish(self, ntr: Sequence[int], nte: Sequence[int], num_classes: int, names: tuple[str, ...],
               doms: tuple[str, ...], binarize: bool) -> Federation:
        parts = []
        for b, ms in enumerate(self.plan):
            (xtr, ytr), (xte, yte) = self.stacks[b]["train"].finish(), self.stacks[b]["test"].finish()
            self.stacks[b] = {}  # the bucket's tensors now belong to its FedData only
            vtr = None if self.views is None else self.views[b]
            if binarize:  # in place: these tensors are ours
                xtr.sign_(), xte.sign_()
                if vtr is not None:
                    vtr.sign_()
            dev = xtr.device
            a, t = [ntr[i] for i in ms], [nte[i] for i in ms]
            mk = lambda ns, n, dev=dev: torch.arange(n, device=dev).view(1, n) < torch.tensor(ns, device=dev).view(-1, 1)  # noqa: E731
            parts.append(FedData(
                x_train=xtr, y_train=ytr, m_train=mk(a, xtr.shape[1]), x_test=xte, y_test=yte,
                m_test=mk(t, xte.shape[1]), n_train=tuple(a), n_test=tuple(t), num_classes=int(num_classes),
                client_names=tuple(names[i] for i in ms), domains=tuple(doms[i] for i in ms),
                client_index=torch.tensor(ms, dtype=torch.int64, device=dev), v_train=vtr))
        if len(parts) == 1:
            return parts[0]
        return BucketedFedData(tuple(parts), tuple(self.plan), tuple(ntr), tuple(nte), int(num_classes), names, doms)


def load_fed_data(store: str | Path | StoreInfo, backbones: Sequence[str], device: str | torch.device = "auto",
                  binarize: bool = False, views: bool = False,
                  clients: Sequence[str] | None = None, chunk_rows: int = 4096,
                  layout: str | LayoutConfig = "padded", may_stream: bool = True) -> Federation:
    """FedData (or, with `layout` "bucketed" / "auto", possibly a BucketedFedData; with "streamed" a
    StreamedFedData, which reads each bucket from the store when the engine needs it: fedheads.core.federation;
    "auto" streams too when the layout it would hold takes more than FEATURES_SHARE of the memory
    available on the device, `_fits`, unless not `may_stream`: the loop engine, which streaming refuses)
    from a feature store (embedcache contract 4), backbones concatenated in order, its clients in
    the store's order. `store`: its path, or the store a run opened (embedcache.store.reader.open_store),
    read as it is (not opened again).

    Each split is read with `embedcache.store.reader.iter_split_chunks` (same checks as `load_split`:
    complete shards, ids/labels equal across backbones, no NaN/inf) in chunks of `chunk_rows`
    rows, each written straight into the padded device tensors (of the client's bucket: the
    sizes in the store's metadata decide the buckets before a feature is read). `views=True` also loads the
    stored augmented views of the train split (extracted with --views V > 1) into `v_train`
    (through `load_split`: per-client copies); FedPCL's code variant contrasts them."""
    from embedcache.store.reader import StoreInfo, check_backbone_identity, check_servable, load_split, open_store

    info = store if isinstance(store, StoreInfo) else open_store(store)
    classes = list(info.classes)
    bbs = list(backbones)
    names = list(clients) if clients is not None else list(info.clients)
    if views:
        if as_layout(layout).layout == "streamed":
            raise UserError("layout streamed: stored augmented views are not streamed; use layout bucketed")
        return _load_with_views(info, bbs, device, binarize, names, len(classes), load_split, layout)
    if not bbs:
        raise UserError("backbones: at least one is needed")
    dev = resolve_device(device)
    dims = _backbone_dims(info, bbs, names)
    check_backbone_identity(info, bbs, names)
    sizes: dict[str, list[int]] = {}
    for split in ("train", "test"):
        shards = [info.shard(bbs[0], c, split) for c in names]
        sizes[split] = [0 if sh is None else sh.n for sh in shards]
    for c in names:
        if info.shard(bbs[0], c, "train") is not None and info.shard(bbs[0], c, "test") is None:
            raise UserError(f"{c}: client has a train split but no test split")
    for c, n in zip(names, sizes["train"]):
        if n == 0 and info.shard(bbs[0], c, "train") is not None:
            raise UserError(f"{c}: no training samples")
    M, D = len(names), sum(dims)
    if M == 0:
        raise UserError("clients: empty federation")
    cfg = as_layout(layout)
    if cfg.layout == "auto" and may_stream and not _fits(sizes["train"], sizes["test"], D, dev, cfg):
        cfg = dataclasses.replace(cfg, layout="streamed")
    if cfg.layout == "streamed":
        check_servable(info, bbs, names)  # what the reads would refuse, refused before the run
        doms = tuple(info.shard(bbs[0], c, "train").domain for c in names)  # type: ignore[union-attr]
        return _streamed(info, bbs, dev, binarize, names, doms, len(classes), sizes, D, chunk_rows, cfg)
    build = _Builder([max(n, 1) for n in sizes["train"]], sizes["test"], D, dev, cfg)
    _read_into(build, info, bbs, names, range(M), sizes, len(classes), D, chunk_rows)
    doms = tuple(info.shard(bbs[0], c, "train").domain for c in names)  # type: ignore[union-attr]
    return build.finish(sizes["train"], sizes["test"], len(classes), tuple(names), doms, binarize)


FEATURES_SHARE = 0.5  # `auto` holds the features when they take at most this share of the memory available


def available_memory(device: torch.device) -> int | None:
    """Bytes a run could still allocate on `device`: MemAvailable (Linux) for the CPU, the free
    memory of a CUDA device; None where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _fits(ntr: Sequence[int], nte: Sequence[int], dim: int, device: torch.device, cfg: LayoutConfig) -> bool:
    """`auto`'s memory rule: the layout it would hold (padded or bucketed: plan_buckets) takes at most
    FEATURES_SHARE of the memory available; otherwise the run streams its buckets from the store,
    with one note saying so (the results are the bucketed layout's, bit for bit)."""
    ntr = [max(n, 1) for n in ntr]
    plan = plan_buckets(ntr, nte, 4 * dim, cfg)
    held = 4 * dim * sum(len(ms) * (a + t) for ms, (a, t) in zip(plan, plan_shapes(plan, ntr, nte)))
    free = available_memory(device)
    if free is None or held <= FEATURES_SHARE * free:
        return True
    print(f"note: the features ({held / 1e9:.2f} GB held) would take more than {FEATURES_SHARE:.0%} of the "
          f"{free / 1e9:.2f} GB available on {device}: reading them from the store bucket by bucket as the "
          "rounds need them (--layout streamed; --layout bucketed holds them)", file=sys.stderr, flush=True)
    return False


def _read_into(build: _Builder, info: StoreInfo, bbs: list[str], names: Sequence[str], which: Sequence[int],
               sizes: dict[str, list[int]], num_classes: int, D: int, chunk_rows: int,
               splits: Sequence[str] = ("train", "test")) -> None:
    """Clients `which` (positions in `names`) read into `build` at positions 0, 1, ... chunk by
    chunk (iter_split_chunks: checked reads), `sizes[split]` set to the rows each really holds."""
    from embedcache.store.reader import iter_split_chunks

    for split in splits:
        for p, i in enumerate(which):
            row, cap, c = 0, build.capacity(split, p), names[i]
            for x, y, _ in iter_split_chunks(info, bbs, split, c, chunk_rows):
                if row + len(y) > cap or x.shape[1] != D:
                    raise UserError(f"{c}/{split}: shard sizes differ from the store's metadata")
                _check_labels(y, num_classes, f"{c}/{split}")
                build.put(split, p, row, x, y)
                row += len(y)
            sizes[split][i] = row


def _streamed(info: StoreInfo, bbs: list[str], dev: torch.device, binarize: bool, names: list[str],
              doms: tuple[str, ...], num_classes: int, sizes: dict[str, list[int]], D: int, chunk_rows: int,
              cfg: LayoutConfig) -> StreamedFedData:
    """The store's clients as a StreamedFedData: the bucketed plan from the metadata's sizes, each
    bucket read (checked, as above) when the engine asks for it. The store stays open for the run.
    A bucket whose shards no longer hold the sizes the plan was made from is one UserError."""
    from embedcache.store.reader import features_identity

    ntr, nte = [max(n, 1) for n in sizes["train"]], list(sizes["test"])
    plan = plan_buckets(ntr, nte, 4 * D, cfg)

    def read_bucket(b: int, train: bool) -> FedData:
        ms = plan[b]  # without `train`, the training arrays are empty: the evaluation reads only the test split
        build = _Builder([ntr[i] if train else 0 for i in ms], [nte[i] for i in ms], D, dev, LayoutConfig("padded"))
        got: dict[str, list[int]] = {"train": list(ntr), "test": list(nte)}
        splits = ("train", "test") if train else ("test",)
        try:
            _read_into(build, info, bbs, names, ms, got, num_classes, D, chunk_rows, splits)
        except UserError:  # a shard written again since the run opened the store is not damage: say so
            from embedcache.store.reader import changed_since_open

            for i in ms:
                for split in splits:
                    path = changed_since_open(info, bbs, names[i], split)
                    if path is not None:
                        raise UserError(f"{path}: extracted or imported again since this run opened the store "
                                        "(changed during the run); start the run again") from None
            raise
        for split, want in (("train", ntr), ("test", nte)):
            bad = next((names[i] for i in ms if got[split][i] != want[i]), None)
            if bad is not None:
                raise UserError(f"{bad}/{split}: shard sizes differ from the store's metadata (changed during the run?)")
        part = build.finish([ntr[i] for i in ms], [nte[i] for i in ms], num_classes,
                            tuple(names[i] for i in ms), tuple(doms[i] for i in ms), binarize)
        assert isinstance(part, FedData)
        return dataclasses.replace(part, client_index=torch.tensor(ms, dtype=torch.int64, device=dev))

    identity = features_identity(info, bbs, names) + (":sign" if binarize else "")
    return StreamedFedData(read_bucket, tuple(plan), plan_shapes(plan, ntr, nte), tuple(ntr), tuple(nte), num_classes,
                           tuple(names), doms, D, dev, identity)


def _backbone_dims(info: Any, bbs: list[str], names: list[str]) -> list[int]:
    """Feature dimension of each backbone, the same for every client (else UserError)."""
    dims, wanted = [], set(names)  # a set: at 1,000s of clients a list made this scan quadratic
    for b in bbs:
        ds = sorted({sh.dim for sh in info.shards if sh.backbone == b and sh.client in wanted})
        if len(ds) > 1:
            raise UserError(f"features: dimension differs across clients {ds} (backbone {b})")
        dims.append(ds[0] if ds else 0)
    return dims


def _load_with_views(store: StoreInfo, bbs: list[str], device: str | torch.device, binarize: bool,
                     names: list[str], num_classes: int, load_split: Any,
                     layout: str | LayoutConfig) -> Federation:
    train = load_split(store, bbs, "train", clients=names, views=True)
    test = load_split(store, bbs, "test", clients=names)
    arrs = []
    for n in train:
        tr, te = train[n], test.get(n)
        if te is None:
            raise UserError(f"{n}: client has a train split but no test split")
        arrs.append((tr.features, tr.labels, te.features, te.labels))
    return from_arrays(arrs, num_classes, list(train), [train[n].domain for n in train], device, binarize,
                               train_views=[train[n].views for n in train], layout=layout)


def federation_of(data: Any, num_classes: int | None, device: str, binarize: bool, layout: str) -> Any:
    """A federation from numpy arrays per client in `layout` (a FedData given is used as it is).
    "auto" stacks arrays padded, as before layouts existed: their padding is the caller's arrays'."""
    from fedheads.core.federation import FedData

    if isinstance(data, FedData):
        return data
    names, clients = ([str(k) for k in data], list(data.values())) if isinstance(data, Mapping) else (None, list(data))
    for i, c in enumerate(clients):
        if not isinstance(c, (tuple, list)) or len(c) != 4:
            raise UserError(f"{names[i] if names else f'client #{i}'}: expected (x_train, y_train, x_test, y_test), "
                            f"got {type(c).__name__}")
    if num_classes is None:  # labels are 0..C-1
        tops = [int(np.max(y)) for c in clients for y in (c[1], c[3]) if len(y)]
        num_classes = max(tops) + 1 if tops else 0
    return from_arrays([tuple(c) for c in clients], num_classes, names, device=device, binarize=binarize,
                       layout="padded" if layout == "auto" else layout)
