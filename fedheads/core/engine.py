"""Simulation engines: run one algorithm definition over a federation, either with all
participating clients stacked in one call ("vectorized") or one client at a time with M=1
("loop", the debugging reference). Both see identical participants, batches and noise, so
they give the same states and accuracies up to float rounding (tests/test_engine_equivalence.py).

The vectorised engine runs one call per group of the data's layout (fedheads/core/federation.py): the
padded FedData is one group; a BucketedFedData runs each size bucket's participants as one stacked
call on its own FedData, or the participants of several buckets in one call where their padding
stays bounded (core/grouping.py), writes the new client states into the federation's stacked
state, and hands the server the messages of all calls in participant order, as one stacked call would.
With `reorder=True` it may stack a padded federation's clients in the order it computes fastest
in (core/order.py) and puts every result back in the data's order.

Per round: select participants (seeded, same in both engines) -> client_update -> server_aggregate
-> (every `eval_every` rounds) per-client test accuracy with `predict` (of the state the optional
`adapt_for_eval` hook gives, core/protocol.py). Communication actually
sent is logged per round: uplink = sum of participants' message sizes, downlink = broadcast size
times the number of participants."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Protocol

import torch

from embedcache.errors import UserError
from fedheads.core import grouping, ops, rng
from fedheads.core.federation import FedData, Federation
from fedheads.core.ops import masked_accuracy
from fedheads.core.order import cat_put_back, put_back, stacking_order
from fedheads.core.protocol import Algorithm, AlgorithmBase, Init, RoundCtx
from fedheads.core.schedule import evaluated as due
from fedheads.core.tree import (
    RaggedRows,
    payload_size,
    row_range,
    shares_memory,
    tree_cat,
    tree_index,
    tree_leaves,
    tree_map,
    tree_put_rows_,
    tree_rows,
    tree_scatter,
    tree_scatter_,
    unshared,
)

ENGINES = ("vectorized", "loop")


@dataclass(frozen=True)
class CommRecord:
    """Traffic of one round (sums over participants)."""

    up_values: int  # values (floats/ints/bools) uploaded by all participants
    up_bytes: int  # bytes uploaded by all participants
    down_values: int  # values broadcast to all participants
    down_bytes: int  # bytes broadcast to all participants


@dataclass(frozen=True)
class RoundRecord:
    """What happened in one round."""

    round: int  # 0-based round
    participants: tuple[int, ...]  # positions of the clients that trained (RoundCtx.participants)
    comm: CommRecord  # traffic of the round
    accuracy: dict[str, torch.Tensor] | None  # rule -> [M] per-client test accuracy (cpu), None if not evaluated
    seconds: float  # wall time of the round's training (client updates + aggregation), not evaluation
    cpu_seconds: float = 0.0  # process CPU time (all threads) of the same training part
    eval_seconds: float = 0.0  # wall time of the round's evaluation (0 when not evaluated)
    eval_cpu_seconds: float = 0.0  # process CPU time of the evaluation


@dataclass
class RunResult:
    """Everything a run produced."""

    algorithm: str
    engine: str
    history: list[RoundRecord] = field(default_factory=list)
    client_state: Any = None
    server_state: Any = None
    trainable_params_per_client: int = 0  # from the actual tensors
    upload_values_per_client: int = 0  # values one participant uploaded in the last round
    wall_seconds: float = 0.0  # whole run: init + every round's training and evaluation
    cpu_seconds: float = 0.0  # process CPU time (all threads) of the same
    resumed_from: int | None = None  # rounds a checkpoint had done when this run took over (None: from scratch)

    def final_accuracy(self, rule: str = "main") -> torch.Tensor:
        """[M] per-client accuracy of the last evaluated round."""
        for rec in reversed(self.history):
            if rec.accuracy is not None:
                return rec.accuracy[rule]
        raise UserError("run: no round was evaluated")

    def total_comm(self) -> CommRecord:
        h = self.history
        return CommRecord(sum(r.comm.up_values for r in h), sum(r.comm.up_bytes for r in h),
                          sum(r.comm.down_values for r in h), sum(r.comm.down_bytes for r in h))


@dataclass
class RunState:
    """Where a run stands after `round` rounds: all it needs to go on. The randomness is
    counter-based (core/rng.py), so continuing from a RunState ends exactly where an
    uninterrupted run ends (fedheads.run.train writes one per round as a checkpoint)."""

    round: int  # rounds done
    client_state: Any
    server_state: Any
    broadcast: Any  # what round `round`'s participants receive
    history: list[RoundRecord]
    upload_values_per_client: int = 0


class Checkpointer(Protocol):
    """What `run` needs to continue a run and to record its progress."""

    def load(self, init: Init) -> RunState | None:
        """The state to continue from (its trees shaped like `init`'s), or None: start afresh."""
        ...

    def save(self, state: RunState) -> None:
        """Called after every round."""
        ...


def clock(device: torch.device) -> tuple[float, float]:
    """(wall, process CPU) seconds now; on CUDA after the queued kernels have finished, so an
    interval measures the work and not just its launch (one sync per reading, never per step)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter(), time.process_time()


def select_participants(num_clients: int, fraction: float, seed: int, round_: int) -> torch.Tensor:
    """Sorted global ids of max(1, round(fraction*M)) clients chosen by seeded hash keys."""
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"fraction {fraction}: must be in (0, 1]")
    k = max(1, int(round(fraction * num_clients)))
    if k >= num_clients:
        return torch.arange(num_clients)
    keys = rng.hash_keys(seed, round_, 0x5E1EC7, torch.arange(num_clients))
    return torch.sort(torch.argsort(keys, stable=True)[:k]).values


EVAL_GROUP_BYTES = 32 << 20  # padded test features per `predict` call of the vectorised engine


BetweenBuckets = Callable[[], None]  # called after each size bucket's work (run's `between_buckets`)
# run's `progress` hook: (rounds done, rounds in all, the round just done), called once before the
# first round with None and after every round (a progress bar is the caller's, e.g. fedheads.run.progress)
Progress = Callable[[int, int, "RoundRecord | None"], None]


def eval_client_state(algorithm: Algorithm, client_state: Any, server_state: Any, data: Federation,
                      engine: str = "vectorized") -> Any:
    """The client state that is evaluated: what `algorithm.adapt_for_eval(...)` returns, or
    `client_state` itself where it returns None (AlgorithmBase's default; core/protocol.py)."""
    if type(algorithm).adapt_for_eval is AlgorithmBase.adapt_for_eval:
        return client_state  # the default adapts nothing: skip the per-bucket calls
    adapt: Any = algorithm.adapt_for_eval  # on one bucket or the whole federation alike
    if engine == "vectorized":
        groups = data.groups()
        if len(groups) == 1:
            return adapt(client_state, server_state, groups[0][1])
        parts: list[Any] = []
        order: list[int] = []
        for ms, bucket in groups:
            parts.append(adapt(tree_rows(client_state, ms, data.device), server_state, bucket))
            order += ms
        return cat_put_back(parts, order, data.device)  # each bucket's rows to their place: one whole copy
    parts = [adapt(tree_index(client_state, torch.tensor([i], device=data.device)), server_state, data.select([i]))
             for i in range(data.num_clients)]
    return tree_cat(parts)


def evaluate(algorithm: Algorithm, client_state: Any, server_state: Any, data: Federation,
             engine: str = "vectorized", adapt: bool = True,
             between_buckets: BetweenBuckets | None = None) -> dict[str, torch.Tensor]:
    """Per-client test accuracy [M] (cpu float64) for every rule `predict` returns, of the
    state `eval_client_state` gives (`adapt=False`: `client_state` is already that state).

    The vectorised engine predicts for groups of clients whose padded test features stay under
    EVAL_GROUP_BYTES (all at once for small federations): predict's temporaries (float64 copies,
    normalised features, scores) then stay bounded at 1,000s of clients; bucketed data is
    evaluated bucket by bucket, each in such groups (`between_buckets` called after each). The
    loop: one at a time.
    Groups are views of the data and of the client state (a copy of a bucket's rows of the
    state only where they are not consecutive)."""
    if adapt:
        client_state = eval_client_state(algorithm, client_state, server_state, data, engine)
    groups = data.groups(train=False)  # predict reads the test split only (a streamed bucket: only it is read)
    if len(groups) == 1:
        return _evaluate_padded(algorithm, client_state, server_state, groups[0][1], engine)
    out: dict[str, torch.Tensor] = {}
    for ms, bucket in groups:
        acc = _evaluate_padded(algorithm, tree_rows(client_state, ms, data.device), server_state, bucket, engine)
        for k, v in acc.items():
            out.setdefault(k, torch.full((data.num_clients,), float("nan"), dtype=v.dtype))[list(ms)] = v
        if between_buckets is not None:
            between_buckets()
    return out


def _evaluate_padded(algorithm: Algorithm, client_state: Any, server_state: Any, data: FedData,
                     engine: str) -> dict[str, torch.Tensor]:
    per_client = data.x_test.shape[1] * data.dim * data.x_test.element_size()
    group = 1 if engine != "vectorized" else max(1, EVAL_GROUP_BYTES // max(per_client, 1))
    if group >= data.num_clients:
        scores = algorithm.predict(client_state, server_state, data.x_test, data.m_test)
        return {k: masked_accuracy(v, data.y_test, data.m_test).cpu() for k, v in scores.items()}
    parts: list[dict[str, torch.Tensor]] = []
    for a in range(0, data.num_clients, group):
        b = min(a + group, data.num_clients)
        sub = data.client_range(a, b)  # views: nothing is copied
        cs = tree_map(lambda t: t[a:b], client_state)  # noqa: B023 (used at once)
        scores = algorithm.predict(cs, server_state, sub.x_test, sub.m_test)
        parts.append({k: masked_accuracy(v, sub.y_test, sub.m_test).cpu() for k, v in scores.items()})
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def participant_groups(data: Federation, participants: torch.Tensor, size: int | None = None, views: bool = False,
                       between_buckets: BetweenBuckets | None = None,
                       regroup: bool = False, state_bytes: int = 0) -> Iterator[tuple[list[int], FedData]]:
    """The walk both vectorised client steps share: per group of the layout, its participants
    (`participants`, global ids) in runs of at most `size` (None: all of the group's at once), as
    (their global ids, their FedData). The FedData is the group itself when all of it takes part,
    else a trimmed copy of their rows (FedData.select), or with `views` a view of them where they
    are consecutive (FedData.client_range: no copy, the train padding kept). `regroup` (with
    `size` None): the groups' participant sets are merged into fewer calls within a bound on their
    padding and on their client state, at `state_bytes` per client (core/grouping.py), a merged
    call's participants stacked largest first in a copy of their rows (BucketedFedData.select).
    `between_buckets` is called after each call's group holding participants, once the caller has
    let go of its last FedData."""
    taking = set(participants.tolist())
    groups = data.groups()  # a streamed federation's are read only when indexed, below
    units = []  # per group holding participants: (the group's index, its positions, the participants' places in it)
    for g, ms in enumerate(data.members):
        loc = [p for p, i in enumerate(ms) if i in taking]
        if loc:
            units.append((g, ms, loc))
    plan = [[u] for u in range(len(units))]
    if regroup and size is None and len(units) > 1:
        shapes = [(len(ms), a + t) for ms, (a, t) in zip(data.members, data.shapes)]
        row_bytes = data.dim * 4 * (1 + data.views_per_row)  # stored augmented views: V more rows per training row
        plan = grouping.merge_units([[ms[p] for p in loc] for _, ms, loc in units],
                                    [len(loc) == len(ms) for _, ms, loc in units], data.n_train, data.n_test,
                                    max(grouping.GROUP_BYTES // row_bytes, *(k * n for k, n in shapes)),
                                    grouping.max_clients([k for k, _ in shapes], state_bytes), grouping.ROUND_WASTE)
    for us in plan:
        if len(us) > 1:  # one call for several groups' participants, largest first (core/train.py's step prefix)
            ids = sorted((units[u][1][p] for u in us for p in units[u][2]), key=lambda i: (-data.n_train[i], i))
            yield ids, data.select(ids)
            if between_buckets is not None:
                between_buckets()
            continue
        g, ms, loc = units[us[0]]
        group = groups[g][1]
        step = size or len(loc)
        for a in range(0, len(loc), step):
            sel = loc[a:a + step]
            span = row_range(sel) if views else None
            # yielded unnamed: the caller holds the only reference, so dropping it frees the copy
            yield [ms[p] for p in sel], (group if len(sel) == len(ms) else
                                         group.client_range(*span) if span is not None else group.select(sel))
        del group  # a streamed bucket is freed before the next is read
        if between_buckets is not None:
            between_buckets()


def update_rows(algorithm: Algorithm, client_state: Any, ids: Sequence[int], device: torch.device,
                views: bool = True) -> Any:
    """Rows `ids` of the client state that `client_update` is given: views where they are
    consecutive (with `views`), else a copy (tree_rows / tree_index); a field the algorithm
    replaces unread (`update_replaces`, e.g. FedAvg's model per client) is the first
    participant's row seen by all of them, nothing copied: gathered, it was one more copy of
    every participant's model per round, never read (a merged call's participants, from several
    buckets, seldom are consecutive rows; a bucket's single participant always is)."""
    gather = ((lambda t: tree_rows(t, ids, device)) if views else
              (lambda t: tree_index(t, torch.tensor(list(ids), dtype=torch.int64, device=device))))
    skip = algorithm.update_replaces
    if not skip or not is_dataclass(client_state) or isinstance(client_state, type):
        return gather(client_state)
    k, i = len(ids), ids[0]
    seen = lambda t: t[i:i + 1].expand(k, *t.shape[1:])  # noqa: E731
    return replace(client_state, **{f.name: tree_map(seen, getattr(client_state, f.name)) if f.name in skip
                                    else gather(getattr(client_state, f.name)) for f in fields(client_state)})


MESSAGE_KEEP_BYTES = 256 << 20  # message stacks a run keeps for its next round (MessagePool)


class MessagePool:
    """The buffers a run's rounds stack their participants' messages in, kept from round to round
    (the engine's run holds one): a fresh [P, ...] stack per round is page-faulted anew, since
    glibc hands blocks above 32 MB back to the OS on free (100 clients of a 1,280 x 256 head:
    131 MB per round; docs/benchmarks.md has the measured cost). A stack is handed out only after the
    previous round's server step is done with it (`release_held_by`), and a buffer that the new
    server state or broadcast still views is dropped from the pool, never written again. Kept
    stacks are held through the evaluation and the next round's first call too, so the pool keeps
    at most MESSAGE_KEEP_BYTES: larger stacks are freed after each server step, as without it."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def stack(self, like: Any, rows: int) -> Any:
        """`like`'s tree with every leaf an uninitialised [rows, ...] view of a pooled buffer."""
        count = itertools.count()

        return tree_map(lambda t: ops.pooled_rows(self.buffers, next(count), rows, t), like)

    def release_held_by(self, *trees: Any) -> None:
        """After a server step: drop every buffer whose memory a leaf of `trees` shares (a server
        state that keeps a view of its message: it is theirs now), and all of them when they hold
        more than MESSAGE_KEEP_BYTES."""
        if not self.buffers:
            return
        if sum(b.numel() * b.element_size() for b in self.buffers.values()) > MESSAGE_KEEP_BYTES:
            self.buffers.clear()
            return
        for key in [k for k, b in self.buffers.items() if shares_memory(b, trees)]:
            del self.buffers[key]


def client_updates(algorithm: Algorithm, client_state: Any, broadcast: Any, data: Federation, ctx: RoundCtx,
                   between_buckets: BetweenBuckets | None = None, in_place: bool = False,
                   message_pool: MessagePool | None = None) -> tuple[Any, Any]:
    """The vectorised engine's client step: `client_update` of the participants `ctx.participants`
    in one stacked call per group of the layout; returns (the federation's client state, the
    participants' stacked messages in participant order).

    Padded data: one call (the participants selected when not everyone takes part; their rows
    written back into `client_state` in place when `in_place`, the caller owning it, else into a
    copy). Bucketed data: one call per bucket holding participants, or per merged group of several
    buckets' participants (participant_groups' `regroup`), each on its FedData and its clients'
    rows of the state (`update_rows`: none of a field the algorithm replaces unread); the rows are
    written back IN PLACE into `client_state` (the caller's own, see `owned`), so no per-round copy
    of a federation's worth of state is made; `between_buckets` is called after each bucket. With
    `message_pool` (the engine's run), the stack the buckets' messages are copied into is the
    pool's, reused from round to round (MessagePool)."""
    part, M, dev = ctx.participants, data.num_clients, data.device
    if isinstance(data, FedData):
        pidx = part.to(dev)
        everyone = len(part) == M
        sub = data if everyone else data.select(part)
        cs_sub = client_state if everyone else update_rows(algorithm, client_state, part.tolist(), dev, views=False)
        cs_sub, msg = algorithm.client_update(cs_sub, broadcast, sub, ctx)
        if everyone:
            return cs_sub, msg
        # the participants' rows written back: in place when the caller owns the state (`in_place`,
        # the engine's run: a copy of a federation's worth of state per round was most of a round
        # whose clients keep a model each), else into a copy
        return (tree_scatter_ if in_place else tree_scatter)(client_state, pidx, cs_sub), msg
    row = {i: r for r, i in enumerate(part.tolist())}  # a participant's row of the round's messages
    # a partial round's calls may stack several buckets' participants (grouping.py), so its first,
    # largest call can need far more scratch than the rest: kept in the pool, it would sit beside
    # the round's messages as they are copied and collected (at full participation every bucket
    # is its own call, and the pool is shared by them as ops.scratch says)
    partial = len(part) < M
    out: Any = None
    msgs, order = [], []  # RaggedRows messages (no fixed rows per client): put in order at the end
    state_bytes = payload_size(client_state, per_client=True)[1]  # one client's rows (merged groups bound them)
    for ids, sub in participant_groups(data, part, between_buckets=between_buckets, regroup=True, state_bytes=state_bytes):
        # the bucket's rows of the state: views when they are consecutive (clients stored largest
        # first), so no bucket-sized copy is made for the call (client_update is pure)
        cs_b, msg_b = algorithm.client_update(update_rows(algorithm, client_state, ids, dev), broadcast, sub, ctx)
        if partial:  # the call's scratch (local training's pooled buffers) freed before its messages are copied
            ops.release_scratch()
        if isinstance(msg_b, RaggedRows):  # runs of items per client: kept whole, reordered at the end
            msgs.append(unshared(msg_b, client_state))  # a message viewing the state would change with the write
            order += ids
            tree_put_rows_(client_state, ids, cs_b)
            del cs_b, sub, msg_b
            continue
        # each bucket's messages go straight to their rows (participant order), copied before the
        # state's rows are written (a message may view them), and dropped: the round holds the
        # messages once, not the buckets' parts, their concatenation and its reordering
        if out is None:
            out = (tree_map(lambda t: t.new_empty((len(part), *t.shape[1:])), msg_b) if message_pool is None
                   else message_pool.stack(msg_b, len(part)))
        at = torch.tensor([row[i] for i in ids], dtype=torch.int64)
        tree_map(lambda o, t: o.index_copy_(0, at.to(o.device), t), out, msg_b)  # noqa: B023 (used at once)
        tree_put_rows_(client_state, ids, cs_b)
        del cs_b, sub, msg_b
    if msgs:  # in participant order, each part's rows copied to their place and the part dropped
        return client_state, cat_put_back(msgs, order, dev, between_buckets)
    return client_state, out


MESSAGE_BUDGET = 512 << 20  # bytes of participants' messages the vectorised engine holds at once (sums_messages)


def message_bytes(algorithm: Algorithm, client_state: Any, broadcast: Any, data: Federation, ctx: RoundCtx) -> int:
    """Bytes of one participant's message: a dry run of `client_update` on the round's first
    participant alone (pure, so nothing of it is kept)."""
    i = int(ctx.participants[0])
    for g, ms in enumerate(data.members):
        if i in ms:
            _, msg = algorithm.client_update(tree_rows(client_state, [i], data.device), broadcast,
                                             data.groups()[g][1].select([ms.index(i)]), ctx)
            return payload_size(msg, per_client=True)[1]
    raise ValueError(f"participant {i} is in no group of the federation")


def summing_group(algorithm: Algorithm, per_client_bytes: int, participants: int, budget: int | None) -> int | None:
    """How many participants' messages the engine adds at a time, or None: it holds them all
    (the algorithm does not declare `sums_messages`, or they fit the budget). An algorithm with
    its own `summed_update` holds no per-client message, so it gets whole groups."""
    if not algorithm.sums_messages or budget is None or participants * per_client_bytes <= budget:
        return None
    if type(algorithm).summed_update is not AlgorithmBase.summed_update:
        return participants
    return max(1, budget // max(per_client_bytes, 1))


def summed_updates(algorithm: Algorithm, client_state: Any, broadcast: Any, data: Federation, ctx: RoundCtx,
                   group_size: int, between_buckets: BetweenBuckets | None = None) -> tuple[Any, Any]:
    """`client_updates` for an algorithm whose server step reads only the sum of the messages
    (`sums_messages`): at most `group_size` participants at a time through `summed_update`, each
    group's one-row sum added to the round's as it goes, so no group's messages outlive it.
    The client state's rows are written in place (the caller passes its own copy)."""
    dev, total = data.device, None
    for ids, sub in participant_groups(data, ctx.participants, group_size, views=True,
                                       between_buckets=between_buckets):
        cs_g, msg = algorithm.summed_update(tree_rows(client_state, ids, dev), broadcast, sub, ctx)
        msg = unshared(msg, client_state)
        tree_put_rows_(client_state, ids, cs_g)
        total = msg if total is None else tree_map(torch.add, total, msg)
        del cs_g, sub
    return client_state, total


def owned(client_state: Any, *others: Any) -> Any:
    """`client_state` safe to update in place: a leaf that shares memory with another leaf (of
    itself or of `others`, e.g. the server state) or is not a plain contiguous tensor (an
    expanded view) is replaced by a copy; the others are kept (no copy of the whole state)."""
    seen: dict[int, int] = {}
    for t in tree_leaves((client_state, *others)):
        ptr = t.untyped_storage().data_ptr()
        seen[ptr] = seen.get(ptr, 0) + 1

    def own(t: torch.Tensor) -> torch.Tensor:
        shared = seen[t.untyped_storage().data_ptr()] > 1 and t.numel() > 0
        return t.clone() if shared or not t.is_contiguous() else t

    return tree_map(own, client_state)


def run(algorithm: Algorithm, data: Federation, rounds: int, seed: int = 0, fraction: float = 1.0,
        engine: str = "vectorized", eval_every: int = 1, progress: Progress | bool | None = None,
        checkpoint: Checkpointer | None = None, reorder: bool = False,
        between_buckets: BetweenBuckets | None = None, message_budget: int | None = MESSAGE_BUDGET) -> RunResult:
    """Train `algorithm` for `rounds` communication rounds; see the module docstring. With a
    `checkpoint`, the run continues from the state its `load` gives and hands it a RunState
    after every round (in the order the clients are stacked in, which the run's arguments fix).

    `reorder=True`: the engine may stack the clients in the order it computes fastest in
    (core/order.py: largest first, one copy of a padded federation's rows); the result is in
    `data`'s client order either way, and a client's own result does not depend on its place
    (only the order of sums over clients does: core/order.py). `between_buckets`: called after
    each size bucket's client updates and evaluation (e.g. to hand freed memory back).
    `message_budget`: bytes of participants' messages the vectorised engine holds at once for an
    algorithm that declares `sums_messages` (beyond it they are added group by group; the sum's
    float rounding then follows the groups); None holds them all. `progress`: the run's progress
    hook (`Progress`; None or False: no reports), e.g. a bar the caller draws."""
    if progress is True:
        raise TypeError("run(progress=True): the engine draws no bar; pass a Progress hook "
                        "(e.g. fedheads.run.progress.RoundBar)")
    order = stacking_order(algorithm, data, fraction, engine) if reorder else None
    stacked = data if order is None else data.select(order)
    with ops.buffer_pool():  # local training's scratch buffers are reused across rounds
        res = _run(algorithm, stacked, rounds, seed, fraction, engine, eval_every, progress, checkpoint,
                   between_buckets, message_budget)
    return res if order is None else _in_data_order(res, order, algorithm.server_client_fields or ())


def _in_data_order(res: RunResult, order: tuple[int, ...], server_fields: Sequence[str]) -> RunResult:
    """A run of clients stacked in `order` (stacking_order: every client in every round) with the
    client axis put back in the data's order: of the client state, of every round's accuracies
    and of the algorithm's per-client server-state fields `server_fields`."""
    back = lambda tree: put_back(tree, order, torch.device("cpu"))  # noqa: E731 (leaves keep their device)
    history = [replace(r, accuracy=None if r.accuracy is None else back(r.accuracy)) for r in res.history]
    ss = res.server_state
    if server_fields:
        ss = replace(ss, **{f: back(getattr(ss, f)) for f in server_fields})
    return replace(res, history=history, client_state=back(res.client_state), server_state=ss)


def _run(algorithm: Algorithm, data: Federation, rounds: int, seed: int, fraction: float,
         engine: str, eval_every: int, progress: Progress | bool | None, checkpoint: Checkpointer | None,
         between_buckets: BetweenBuckets | None, message_budget: int | None = MESSAGE_BUDGET) -> RunResult:
    if engine not in ENGINES:
        raise UserError(f"engine {engine!r}: must be one of {', '.join(ENGINES)}")
    if rounds < 1:
        raise UserError(f"rounds {rounds}: must be >= 1")
    if data.layout == "streamed" and engine != "vectorized":
        raise UserError(f"layout streamed: the {engine} engine takes one client per call and would read a whole "
                        "bucket for each; use layout bucketed (or the vectorized engine)")
    if eval_every < 0:
        raise UserError(f"eval_every {eval_every}: must be >= 0 (0 = only after the last round)")
    M = data.num_clients
    t_run = clock(data.device)
    init = algorithm.init(data.spec(), seed)
    cstate, sstate, bc = init.client_state, init.server_state, init.broadcast
    res = RunResult(algorithm=algorithm.name, engine=engine)
    res.trainable_params_per_client = algorithm.trainable_params(cstate)
    start = checkpoint.load(init) if checkpoint is not None else None
    if start is not None:
        if start.round > rounds:
            raise UserError(f"checkpoint after round {start.round}: the run has only {rounds} rounds")
        cstate, sstate, bc = start.client_state, start.server_state, start.broadcast
        res.history, res.upload_values_per_client = list(start.history), start.upload_values_per_client
        res.resumed_from = start.round
    first = 0 if start is None else start.round
    per_client: int | None = None  # one participant's message bytes (measured once, for sums_messages)
    messages = MessagePool()  # the rounds' message stacks, reused (vectorised engine)
    if first == rounds:  # every round was done: the final evaluated state again (a pure function)
        evaluated = eval_client_state(algorithm, cstate, sstate, data, engine)
    report = progress if callable(progress) else None
    if report is not None:
        report(first, rounds, None)
    for r in range(first, rounds):
        t0 = clock(data.device)
        part = select_participants(M, fraction, seed, r)
        ctx = RoundCtx(round=r, seed=seed, participants=part, num_clients=M)
        if engine == "vectorized" and algorithm.sums_messages and message_budget is not None and per_client is None:
            per_client = message_bytes(algorithm, cstate, bc, data, ctx)  # once: every round's messages are alike
        group = summing_group(algorithm, per_client or 0, len(part), message_budget) if engine == "vectorized" else None
        if engine == "vectorized":  # client_updates / summed_updates write participants' rows in place:
            cstate = owned(cstate, sstate, bc)  # a copy only of leaves shared with the states (cheap checks)
        if group is not None:
            cstate, msg = summed_updates(algorithm, cstate, bc, data, ctx, group, between_buckets)
        elif engine == "vectorized":
            cstate, msg = client_updates(algorithm, cstate, bc, data, ctx, between_buckets, in_place=True,
                                         message_pool=messages)
        else:
            msgs = []
            # one private copy per round, then in-place row writes (no O(M) copy per client)
            cstate = tree_map(lambda t: t.clone(), cstate)
            for i in part.tolist():
                one = torch.tensor([i], device=data.device)
                cs_i, msg_i = algorithm.client_update(tree_index(cstate, one), bc, data.select([i]), ctx)
                tree_scatter_(cstate, one, cs_i)
                msgs.append(msg_i)
            msg = tree_cat(msgs)
        up_v, up_b = payload_size(msg, per_client=True)
        down_v, down_b = payload_size(bc, per_client=False)
        P = len(part)
        comm = CommRecord(up_v * P, up_b * P, down_v * P, down_b * P)
        res.upload_values_per_client = up_v
        sstate, bc = algorithm.server_aggregate(sstate, msg, ctx)
        messages.release_held_by(sstate, bc)  # a stack the new states view is theirs, not reused
        del msg  # spent: not held through the evaluation and the next round's client updates
        t1 = clock(data.device)
        acc = None
        if due(r + 1, rounds, eval_every):
            evaluated = eval_client_state(algorithm, cstate, sstate, data, engine)
            acc = evaluate(algorithm, evaluated, sstate, data, engine, adapt=False, between_buckets=between_buckets)
        t2 = clock(data.device) if acc is not None else t1
        res.history.append(RoundRecord(r, tuple(part.tolist()), comm, acc, t1[0] - t0[0], t1[1] - t0[1],
                                       t2[0] - t1[0], t2[1] - t1[1]))
        if checkpoint is not None:
            checkpoint.save(RunState(r + 1, cstate, sstate, bc, res.history, res.upload_values_per_client))
        if report is not None:
            report(r + 1, rounds, res.history[-1])
    # the last round is always evaluated: its evaluated state is what a saved state must predict
    res.client_state, res.server_state = evaluated, sstate
    t_end = clock(data.device)
    res.wall_seconds, res.cpu_seconds = t_end[0] - t_run[0], t_end[1] - t_run[1]
    return res


@dataclass(frozen=True)
class ParamCounts:
    """Running-code parameter counts, measured on the actual tensors (not the paper's convention),
    in the steady state: every client participating, in the first round after the algorithm's
    collection rounds (`collect_rounds`, e.g. FedPCL's round 0, LP's FedNCM round)."""

    trainable_per_client: int  # values one client trains
    upload_per_client: int  # values one client uploads per round
    download_per_client: int  # values one client receives per round
    upload_bytes_per_client: int  # bytes uploaded per round
    download_bytes_per_client: int  # bytes received per round


def count_parameters(algorithm: Algorithm, data: Federation, seed: int = 0) -> ParamCounts:
    """Init the algorithm on `data`, run its collection rounds and one more round with every
    client, and measure what is trained, and what one client sends and receives in that round
    (with all of `data`'s clients: FedPCL's download grows with the number of clients)."""
    init = algorithm.init(data.spec(), seed)
    cs, ss, bc = init.client_state, init.server_state, init.broadcast
    if not isinstance(data, FedData):  # client_updates writes the buckets' rows in place
        cs = owned(cs, ss, bc)
    everyone = torch.arange(data.num_clients)
    for r in range(int(algorithm.collect_rounds) + 1):
        received = bc
        ctx = RoundCtx(round=r, seed=seed, participants=everyone, num_clients=data.num_clients)
        cs, msg = client_updates(algorithm, cs, bc, data, ctx)
        ss, bc = algorithm.server_aggregate(ss, msg, ctx)
    up_v, up_b = payload_size(msg, per_client=True)
    down_v, down_b = payload_size(received, per_client=False)
    return ParamCounts(algorithm.trainable_params(init.client_state), up_v, down_v, up_b, down_b)


def to_device(tree: Any, device: torch.device | str) -> Any:
    """Move every tensor leaf (e.g. a final state) to `device`."""
    return tree_map(lambda t: t.to(device), tree)
