"""The federation as the engines hold it: every client's features stacked and padded into dense
tensors [M, Nmax, D] on one device, so an algorithm step touches all clients in one kernel call.
Torch only: reading a store or arrays into these is fedheads.run.load's work.

Three layouts: `FedData` pads every client to the largest ("padded"); `BucketedFedData` holds size
buckets, each an ordinary FedData padded to its own largest client ("bucketed"), so skewed client
sizes cost at most `waste` in padding; `StreamedFedData` holds only the bucketed plan and reads a
bucket when a call needs it ("streamed": a run's memory is then its states plus a bucket, whatever
the federation's size). `Federation` is any of them; the engines run all three (core/engine.py)
and an algorithm only ever sees a FedData.

Padding to the largest client costs M * Nmax rows where the clients hold sum_i N_i: with skewed
(power-law) client sizes that is 10-20x the features at 1,000 clients, and the vectorised step
computes every padded client until the largest one has finished its epoch. Buckets group clients
of similar sizes (train and test), so the padding of a bucket stays under `waste` of its real
rows; the engine runs each bucket as one vectorised call and sums the messages as if all clients
had been stacked (core/engine.py). `bucket_bytes` and `bucket_clients` cap one call: the
temporaries of a call (batch gathers, FedPCL's [M, B, sets, C] logits, the projected training
set of its prototypes, evaluation scores) scale with its clients and rows, not with the
federation's. The algorithm code is the same in both layouts: each call sees an ordinary FedData.

`plan_buckets` is pure Python over the client sizes (known from the store's metadata before a
feature is read), so the loader writes every client straight into its bucket."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from embedcache.errors import UserError


@dataclass(frozen=True)
class DataSpec:
    """What an algorithm needs to know to initialise (no samples)."""

    dim: int  # feature dimension D
    num_classes: int  # C
    num_clients: int  # M of the whole federation
    n_train: tuple[int, ...]  # training samples per client
    device: torch.device  # where states live
    # global ids of the clients in their stacking order (FedData.client_index): per-client
    # initialisations are seeded by them, so a client starts alike in any order; None: 0..M-1
    client_ids: tuple[int, ...] | None = None

    def ids(self) -> tuple[int, ...]:
        return tuple(range(self.num_clients)) if self.client_ids is None else self.client_ids


@dataclass(frozen=True)
class FedData:
    """A (sub-)federation, stacked over clients and padded to the largest client."""

    x_train: torch.Tensor  # [M, Nmax, D] float32 (zeros in padding rows)
    y_train: torch.Tensor  # [M, Nmax] int64 (0 in padding rows)
    m_train: torch.Tensor  # [M, Nmax] bool, True for real rows
    x_test: torch.Tensor  # [M, Tmax, D] float32
    y_test: torch.Tensor  # [M, Tmax] int64
    m_test: torch.Tensor  # [M, Tmax] bool
    n_train: tuple[int, ...]  # real training rows per client (host ints: no device sync)
    n_test: tuple[int, ...]  # real test rows per client
    num_classes: int  # C (labels are 0..C-1)
    client_names: tuple[str, ...]  # names of these clients
    domains: tuple[str, ...]  # domain of each client
    client_index: torch.Tensor  # [M] int64 global client ids (seeds batches/noise per client)
    v_train: torch.Tensor | None = None  # [M, V, Nmax, D] stored augmented views of the train rows, if loaded

    @property
    def num_clients(self) -> int:
        return len(self.client_names)

    @property
    def dim(self) -> int:
        return int(self.x_train.shape[-1])

    @property
    def device(self) -> torch.device:
        return self.x_train.device

    def spec(self) -> DataSpec:
        return DataSpec(self.dim, self.num_classes, self.num_clients, self.n_train, self.device,
                        tuple(self.client_index.tolist()))

    layout = "padded"

    @property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """Client positions per vectorised call (`groups()` without their features): all in one."""
        return (tuple(range(self.num_clients)),)

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Padded (train, test) rows per group."""
        return ((int(self.x_train.shape[1]), int(self.x_test.shape[1])),)

    @property
    def views_per_row(self) -> int:
        """Stored augmented views held per training row (0: none loaded)."""
        return 0 if self.v_train is None else int(self.v_train.shape[1])

    def groups(self, train: bool = True) -> tuple[tuple[tuple[int, ...], FedData], ...]:
        """(client positions, FedData) per vectorised call: here all clients in one. `train=False`:
        the caller reads only the test split (a streamed layout then reads no training rows)."""
        return ((tuple(range(self.num_clients)), self),)

    def class_counts(self) -> torch.Tensor:
        """[M, C] training samples per class (a client lacking a class is normal)."""
        oh = torch.nn.functional.one_hot(self.y_train, self.num_classes) * self.m_train.unsqueeze(-1)
        return oh.sum(1)

    def select(self, idx: Sequence[int] | torch.Tensor) -> FedData:
        """Sub-federation of clients `idx` (positions in this FedData), padding trimmed."""
        ids = [int(i) for i in (idx.tolist() if isinstance(idx, torch.Tensor) else idx)]
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        ntr = tuple(self.n_train[i] for i in ids)
        nte = tuple(self.n_test[i] for i in ids)
        a, b = max(ntr), max(max(nte), 1)
        pick = lambda x, n: x[:, :n].index_select(0, t)  # noqa: E731  (one contiguous copy)
        return FedData(
            x_train=pick(self.x_train, a), y_train=pick(self.y_train, a), m_train=pick(self.m_train, a),
            x_test=pick(self.x_test, b), y_test=pick(self.y_test, b), m_test=pick(self.m_test, b),
            n_train=ntr, n_test=nte, num_classes=self.num_classes,
            client_names=tuple(self.client_names[i] for i in ids),
            domains=tuple(self.domains[i] for i in ids),
            client_index=self.client_index.index_select(0, t),
            v_train=None if self.v_train is None else self.v_train.index_select(0, t)[:, :, :a],
        )

    def by_size(self) -> tuple[FedData, tuple[int, ...]]:
        """(these clients in order of training size, largest first (stable), that order as
        positions in this FedData): the order the vectorised engine stacks them in where it may
        (core/order.py). Itself when already in that order."""
        order = tuple(sorted(range(self.num_clients), key=lambda i: -self.n_train[i]))
        return (self, order) if order == tuple(range(self.num_clients)) else (self.select(order), order)

    def client_range(self, a: int, b: int) -> FedData:
        """Clients a..b-1 as views (no copy): the test padding trimmed to their largest test split,
        the train arrays as they are (evaluation reads only the test split)."""
        t = max(max(self.n_test[a:b]), 1)
        return dataclasses.replace(
            self, x_train=self.x_train[a:b], y_train=self.y_train[a:b], m_train=self.m_train[a:b],
            x_test=self.x_test[a:b, :t], y_test=self.y_test[a:b, :t], m_test=self.m_test[a:b, :t],
            n_train=self.n_train[a:b], n_test=self.n_test[a:b], client_names=self.client_names[a:b],
            domains=self.domains[a:b], client_index=self.client_index[a:b],
            v_train=None if self.v_train is None else self.v_train[a:b])


LAYOUTS = ("auto", "padded", "bucketed", "streamed")


@dataclass(frozen=True)
class LayoutConfig:
    """The layout and the limits of its buckets. The defaults (10 % waste, 64 MiB, 64 clients per bucket) bound
    the padding by construction; they were chosen, not tuned: benchmarks/bench_scale.py measures what they give."""

    # "padded" (one dense tensor), "bucketed", "auto" (bucketed when padding would cost, below) or
    # "streamed" (the bucketed plan, each bucket read when a call needs it: StreamedFedData)
    layout: str = "padded"
    waste: float = 0.1  # bucketed: a bucket's padding rows are at most this fraction of its real rows
    bucket_bytes: int = 64 << 20  # bucketed: padded train+test feature bytes of a bucket at most (a bigger client gets its own)
    bucket_clients: int = 64  # bucketed: clients per bucket at most
    auto_waste: float = 0.5  # auto: bucket when padding adds more than this fraction of the features ...
    auto_min_bytes: int = 64 << 20  # ... and more than this many bytes (small federations stay dense: one call)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise UserError(f"layout {self.layout!r}: must be one of {', '.join(LAYOUTS)}")
        if self.waste < 0 or self.auto_waste < 0 or self.bucket_bytes < 1 or self.bucket_clients < 1:
            raise UserError(f"layout limits: waste {self.waste}, auto_waste {self.auto_waste} must be >= 0, "
                            f"bucket_bytes {self.bucket_bytes}, bucket_clients {self.bucket_clients} >= 1")


def as_layout(layout: str | LayoutConfig) -> LayoutConfig:
    """A LayoutConfig from its name (default limits) or itself."""
    return layout if isinstance(layout, LayoutConfig) else LayoutConfig(layout=str(layout))


def padded_rows(n_train: Sequence[int], n_test: Sequence[int]) -> int:
    """Rows (train + test) the padded layout holds: every client padded to the largest (tensors
    keep at least one test row)."""
    return len(n_train) * (max(n_train) + max(max(n_test), 1))


def bucketing_pays(n_train: Sequence[int], n_test: Sequence[int], row_bytes: int, cfg: LayoutConfig) -> bool:
    """`auto`'s rule: padding adds more than auto_waste of the features and more than auto_min_bytes."""
    real = sum(n_train) + sum(n_test)
    extra = padded_rows(n_train, n_test) - real
    return extra > cfg.auto_waste * real and extra * row_bytes > cfg.auto_min_bytes


def plan_buckets(n_train: Sequence[int], n_test: Sequence[int], row_bytes: int,
                 cfg: LayoutConfig) -> list[tuple[int, ...]]:
    """Client positions per bucket (each ascending); one bucket of everyone for the padded layout.

    Greedy over the clients sorted by (train, test) size: a client joins the open bucket unless
    that would make the bucket's padded rows exceed (1 + waste) x its real rows, its padded bytes
    exceed bucket_bytes, or its clients exceed bucket_clients. Every bucket then wastes at most
    `waste` (a bucket of one client wastes nothing), so the whole layout holds at most
    (1 + waste) x the features (plus one test row for a client without test samples)."""
    M = len(n_train)
    if M == 0:
        raise UserError("clients: empty federation")
    if cfg.layout == "padded" or (cfg.layout == "auto" and not bucketing_pays(n_train, n_test, row_bytes, cfg)):
        return [tuple(range(M))]
    order = sorted(range(M), key=lambda i: (n_train[i], n_test[i], i))
    buckets: list[list[int]] = []
    cur: list[int] = []
    a = b = real = 0  # open bucket: largest train, largest test, real rows
    for i in order:
        na, nb = max(a, n_train[i]), max(b, n_test[i], 1)
        own = n_train[i] + max(n_test[i], 1)  # the test row minimum counts as real: no split for it
        k, r = len(cur) + 1, real + own
        if cur and (k > cfg.bucket_clients or k * (na + nb) * row_bytes > cfg.bucket_bytes
                    or k * (na + nb) > (1.0 + cfg.waste) * r):
            buckets.append(cur)
            cur, na, nb, r = [], n_train[i], max(n_test[i], 1), own
        cur.append(i)
        a, b, real = na, nb, r
    buckets.append(cur)
    return [tuple(sorted(bk)) for bk in buckets]


def plan_shapes(plan: Sequence[Sequence[int]], n_train: Sequence[int], n_test: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Padded (train, test) rows of each bucket of `plan`: its largest client's (a test split keeps
    at least one row)."""
    return tuple((max(n_train[i] for i in ms), max(max(n_test[i] for i in ms), 1)) for ms in plan)


class _Buckets:
    """What a federation of size buckets does the same however it holds them (BucketedFedData
    in memory, StreamedFedData read when asked): `_bucket(b)` gives bucket b's FedData."""

    members: tuple[tuple[int, ...], ...]
    num_classes: int
    client_names: tuple[str, ...]

    def _bucket(self, b: int) -> FedData:
        raise NotImplementedError

    def groups(self, train: bool = True) -> Sequence[tuple[tuple[int, ...], FedData]]:
        raise NotImplementedError

    @property
    def num_clients(self) -> int:
        return len(self.client_names)

    @functools.cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        """client position -> (bucket, position in the bucket)"""
        return {i: (b, p) for b, ms in enumerate(self.members) for p, i in enumerate(ms)}

    def class_counts(self) -> torch.Tensor:
        """[M, C] training samples per class (a streamed federation reads every bucket for it)."""
        out: torch.Tensor | None = None
        for ms, b in self.groups():
            counts = b.class_counts()  # [k, C] int64 on the federation's device
            if out is None:
                out = counts.new_zeros((self.num_clients, self.num_classes))
            out[list(ms)] = counts
        assert out is not None, "a federation has at least one bucket"
        return out

    def select(self, idx: Sequence[int] | torch.Tensor) -> FedData:
        """Sub-federation of clients `idx` (positions, in the order given) as one padded FedData:
        a view-free copy of their rows, as FedData.select gives (e.g. one client for the loop, or a
        round's participants from several buckets stacked in one call, core/grouping.py); each
        bucket they are in is taken (a streamed one read) once."""
        ids = [int(i) for i in (idx.tolist() if isinstance(idx, torch.Tensor) else idx)]
        where = self._where
        rows: dict[int, list[int]] = {}  # bucket -> rows of the result its clients go to
        for r, i in enumerate(ids):
            rows.setdefault(where[i][0], []).append(r)
        parts = [(rs, self._bucket(b).select([where[ids[r]][1] for r in rs])) for b, rs in rows.items()]
        return parts[0][1] if len(parts) == 1 else _stack(parts, len(ids))


@dataclass(frozen=True)
class BucketedFedData(_Buckets):
    """A federation held as size buckets (see above): each bucket an ordinary FedData padded to
    its own largest client, whose `client_index` holds its clients' global ids, so batches and
    noise are those of the padded layout and of the loop. Per-client fields are in federation
    order; the engines iterate `groups()`."""

    buckets: tuple[FedData, ...]  # one vectorised call each
    members: tuple[tuple[int, ...], ...]  # positions (in this federation) of each bucket's clients, ascending
    n_train: tuple[int, ...]  # real training rows per client
    n_test: tuple[int, ...]  # real test rows per client
    num_classes: int  # C
    client_names: tuple[str, ...]  # names of all clients
    domains: tuple[str, ...]  # domain of each client

    layout = "bucketed"

    @property
    def dim(self) -> int:
        return self.buckets[0].dim

    @property
    def device(self) -> torch.device:
        return self.buckets[0].device

    @property
    def client_index(self) -> torch.Tensor:
        """[M] global client ids in federation order."""
        out = torch.empty(self.num_clients, dtype=torch.int64, device=self.device)
        for ms, b in self.groups():
            out[list(ms)] = b.client_index
        return out

    def spec(self) -> DataSpec:
        ids = [0] * self.num_clients  # each position's global id, from its bucket (as FedData.spec)
        for ms, bucket in self.groups():
            for pos, gid in zip(ms, bucket.client_index.tolist()):
                ids[pos] = gid
        return dataclasses.replace(self.buckets[0].spec(), num_clients=self.num_clients, n_train=self.n_train,
                                   client_ids=tuple(ids))

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Padded (train, test) rows per bucket."""
        return tuple((int(b.x_train.shape[1]), int(b.x_test.shape[1])) for b in self.buckets)

    @property
    def views_per_row(self) -> int:
        return self.buckets[0].views_per_row

    def groups(self, train: bool = True) -> tuple[tuple[tuple[int, ...], FedData], ...]:
        return tuple(zip(self.members, self.buckets))

    def _bucket(self, b: int) -> FedData:
        return self.buckets[b]


class StreamedGroups(Sequence):
    """A StreamedFedData's groups: item b is (bucket b's positions, its FedData read now). Nothing is
    kept: iterating reads one bucket after another, and a bucket is freed once its caller lets go."""

    def __init__(self, data: StreamedFedData, train: bool = True) -> None:
        self.data, self.train = data, train

    def __len__(self) -> int:
        return len(self.data.members)

    def __getitem__(self, b: Any) -> Any:
        if not isinstance(b, int):
            raise TypeError("streamed groups are read one at a time: index them with an int")
        return self.data.members[b], self.data.read_bucket(b % len(self), self.train)


@dataclass(frozen=True, eq=False)
class StreamedFedData(_Buckets):
    """A federation that holds only its bucket plan (plan_buckets) and reads a bucket when a
    vectorised call needs it: `read_bucket(b, train)` gives bucket b as the FedData a
    BucketedFedData would hold (its clients' global ids in `client_index`), read afresh each time
    (e.g. from the feature store: fedheads.run.load); with `train` False its training arrays are
    empty ([k, 0, D]: `groups(train=False)`, for the evaluation, which reads only the test split).
    The engine holds at most two buckets of features at once (the one a call uses and the next
    being read), so a run's memory is its states plus a bucket, and its results are the bucketed
    layout's bit for bit (the same buckets, calls and sums). Every pass over the clients reads them
    again: a one-pass head reads the store once for its round and the test split again for its
    evaluation. The loop engine, one client per call, refuses it."""

    read_bucket: Callable[[int, bool], FedData]  # (b, train): bucket b's FedData, read when called
    members: tuple[tuple[int, ...], ...]  # positions of each bucket's clients, ascending
    shapes: tuple[tuple[int, int], ...]  # each bucket's padded (train, test) rows
    n_train: tuple[int, ...]  # real training rows per client
    n_test: tuple[int, ...]  # real test rows per client
    num_classes: int  # C
    client_names: tuple[str, ...]  # names of all clients
    domains: tuple[str, ...]  # domain of each client
    dim: int  # D
    device: torch.device  # where read buckets are put
    identity: str | None = None  # what names the features (e.g. the store's fingerprint) without reading them
    ids: tuple[int, ...] | None = None  # each position's global client id, as its bucket's client_index; None: positions

    layout = "streamed"
    views_per_row = 0  # stored augmented views are not streamed

    def global_ids(self) -> tuple[int, ...]:
        return tuple(range(self.num_clients)) if self.ids is None else self.ids

    @property
    def client_index(self) -> torch.Tensor:
        """[M] global client ids in federation order."""
        return torch.tensor(self.global_ids(), dtype=torch.int64, device=self.device)

    def spec(self) -> DataSpec:
        return DataSpec(self.dim, self.num_classes, self.num_clients, self.n_train, self.device, self.global_ids())

    def groups(self, train: bool = True) -> StreamedGroups:
        return StreamedGroups(self, train)

    def _bucket(self, b: int) -> FedData:
        return self.read_bucket(b, True)


def _stack(parts: Sequence[tuple[list[int], FedData]], k: int) -> FedData:
    """FedDatas of disjoint clients as one of `k` clients, padded to the largest: part (rows, d)'s
    clients go to rows `rows` (one copy of each part into zeroed tensors; cross-bucket selections)."""
    first = parts[0][1]
    a, b = max(p.x_train.shape[1] for _, p in parts), max(p.x_test.shape[1] for _, p in parts)
    at = [torch.tensor(rs, dtype=torch.int64, device=first.device) for rs, _ in parts]

    def place(field: str, n: int, axis: int = 1) -> torch.Tensor:
        ts = [getattr(p, field) for _, p in parts]
        shape = list(ts[0].shape)
        shape[0], shape[axis] = k, n
        out = ts[0].new_zeros(shape)  # padding: zero features and labels, False masks
        for t, r in zip(ts, at):
            out.narrow(axis, 0, t.shape[axis]).index_copy_(0, r, t)
        return out

    def per_client(field: str) -> tuple:
        out: list = [None] * k
        for rs, p in parts:
            for r, v in zip(rs, getattr(p, field)):
                out[r] = v
        return tuple(out)

    index = first.client_index.new_empty(k)
    for (_, p), r in zip(parts, at):
        index.index_copy_(0, r, p.client_index)
    has_v = all(p.v_train is not None for _, p in parts)
    return dataclasses.replace(
        first, x_train=place("x_train", a), y_train=place("y_train", a), m_train=place("m_train", a),
        x_test=place("x_test", b), y_test=place("y_test", b), m_test=place("m_test", b),
        n_train=per_client("n_train"), n_test=per_client("n_test"), client_names=per_client("client_names"),
        domains=per_client("domains"), client_index=index, v_train=place("v_train", a, 2) if has_v else None)


def to_layout(data: Federation, layout: str | LayoutConfig) -> Federation:
    """`data` in another layout (a copy of the rows; the same clients, order and global ids).
    "streamed" reads each bucket out of `data` when it is needed (a copy of its rows then)."""
    cfg = as_layout(layout)
    plan = plan_buckets(data.n_train, data.n_test, 4 * data.dim, cfg)
    if cfg.layout == "streamed":
        return StreamedFedData(lambda b, train: without_train(data.select(list(plan[b])), train), tuple(plan),
                               plan_shapes(plan, data.n_train, data.n_test), tuple(data.n_train),
                               tuple(data.n_test), data.num_classes, tuple(data.client_names), tuple(data.domains),
                               data.dim, data.device, ids=tuple(data.client_index.tolist()))
    if len(plan) == 1:
        return data if data.layout == "padded" else data.select(range(data.num_clients))
    return BucketedFedData(tuple(data.select(list(ms)) for ms in plan), tuple(plan), tuple(data.n_train),
                           tuple(data.n_test), data.num_classes, tuple(data.client_names), tuple(data.domains))


def without_train(data: FedData, train: bool = False) -> FedData:
    """`data` with no training rows (x_train [M, 0, D]; n_train kept), unless `train`: what a
    streamed bucket read for the evaluation holds."""
    if train:
        return data
    return dataclasses.replace(data, x_train=data.x_train[:, :0], y_train=data.y_train[:, :0],
                               m_train=data.m_train[:, :0], v_train=None)


def layout_info(data: Federation) -> dict[str, Any]:
    """What results.json records about the layout that ran (docs/contracts.md section 6)."""
    real = (sum(data.n_train) + sum(data.n_test)) * data.dim * 4
    per_group = [len(ms) * (a + t) * data.dim * 4 for ms, (a, t) in zip(data.members, data.shapes)]
    held = max(per_group) if data.layout == "streamed" else sum(per_group)  # streamed: one bucket at a time
    return {"name": data.layout, "buckets": len(data.groups()), "feature_bytes": int(real),
            "held_feature_bytes": int(held), "padding_multiple": round(sum(per_group) / max(real, 1), 4)}


Federation = FedData | BucketedFedData | StreamedFedData  # the three layouts
