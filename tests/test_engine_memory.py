"""What the vectorised engine holds in a round on a bucketed federation, at no cost to the numbers:

- a round's RaggedRows messages (FedCOF's class means, a run of items per client) from its
  buckets' calls are put into participant order with one copy of their items: each part's rows go
  straight to their place (core/order.py cat_put_back), where concatenating the parts and
  reordering the concatenation held the items twice; the message is put_back(tree_cat(parts)) bit
  for bit;
- in a partial round, whose calls may stack several buckets' participants (core/grouping.py), a
  call's pooled scratch (local training's gradient buffers) is freed before its messages are
  copied into the round's, instead of sitting beside them (ops.release_scratch): LP's merged call
  of 64 clients kept 64 heads' gradients beside the round's 100 messages;
- the state a bucketed federation is evaluated in (adapt_for_eval, per bucket) is put in order
  the same way, one copy of every client's personalised head;
- a run's rounds copy their messages into stacks the engine reuses (engine.MessagePool), never
  into one a server state still views."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_fedcof import _Allocations

from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig
from fedheads.algorithms.fedcof import FedCOF, FedCOFClientState, FedCOFConfig
from fedheads.algorithms.lp import HeadTuning, LPConfig
from fedheads.core import engine, grouping, ops, select_participants
from fedheads.core import order as order_mod
from fedheads.core.engine import client_updates, participant_groups
from fedheads.core.federation import BucketedFedData, LayoutConfig, to_layout
from fedheads.core.order import cat_put_back, put_back
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import tree_cat, tree_leaves, tree_rows
from fedheads.run.load import from_arrays


@dataclass(frozen=True)
class Runs:
    """A toy RaggedRows: per client a count [M] and two per-item leaves of rows, one per-client
    leaf of rows, one per-item label."""

    n: torch.Tensor  # [M]
    rows: torch.Tensor  # [Q, 3]
    wide: torch.Tensor  # [Q, 2, 2]
    label: torch.Tensor  # [Q]
    own: torch.Tensor  # [M, 2]

    def client_rows(self, idx: torch.Tensor) -> Runs:
        start = torch.cumsum(self.n, 0) - self.n
        n = self.n[idx]
        item = torch.repeat_interleave(start[idx] - (torch.cumsum(n, 0) - n), n) + torch.arange(int(n.sum()))
        return Runs(n, self.rows[item], self.wide[item], self.label[item], self.own[idx])

    def comm_size(self) -> tuple[int, int]:
        return 0, 0


def runs(n: list[int], seed: int) -> Runs:
    g = torch.Generator().manual_seed(seed)
    q = sum(n)
    return Runs(torch.tensor(n), torch.randn(q, 3, generator=g), torch.randn(q, 2, 2, generator=g),
                torch.randint(0, 9, (q,), generator=g), torch.randn(len(n), 2, generator=g))


def test_cat_put_back_equals_put_back_of_the_concatenation_and_drops_the_parts(monkeypatch) -> None:
    parts = [runs([2, 0, 3], 0), runs([1], 1), runs([4, 1], 2)]
    order = [4, 0, 2, 5, 1, 3]  # the position of each concatenated client
    want = put_back(tree_cat(parts), order, torch.device("cpu"))
    released = []
    got = cat_put_back(list(parts), order, torch.device("cpu"), lambda: released.append(1))
    for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert len(released) == 1  # after the last part: the three hold fewer than RELEASE_BYTES
    monkeypatch.setattr(order_mod, "RELEASE_BYTES", 1)
    cat_put_back(list(parts), order, torch.device("cpu"), lambda: released.append(1))
    assert len(released) == 4  # then after each part
    held = list(parts)
    cat_put_back(held, order, torch.device("cpu"))
    assert held == []  # the caller's list is emptied: no part outlives its copy
    # already in order (one part, or parts whose clients come in order): the concatenation
    same = cat_put_back(list(parts), list(range(6)), torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(same), tree_leaves(tree_cat(parts)), strict=True))
    # fixed rows per client (no RaggedRows): every leaf's rows put in order alike
    fixed = [{"w": torch.randn(3, 2, 2), "n": torch.arange(3.0)}, {"w": torch.randn(2, 2, 2), "n": torch.arange(2.0)}]
    want = put_back(tree_cat(fixed), [1, 4, 0, 3, 2], torch.device("cpu"))
    got = cat_put_back(list(fixed), [1, 4, 0, 3, 2], torch.device("cpu"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def skewed(M: int = 48, D: int = 5, C: int = 4, seed: int = 0) -> BucketedFedData:
    rs = np.random.default_rng(seed)
    clients = []
    for _ in range(M):
        n = int(min(rs.pareto(1.2) * 4 + 1, 90))
        y = rs.integers(0, C, n)
        yt = rs.integers(0, C, 3)
        clients.append((rs.normal(size=(n, D)).astype("f4") + y[:, None], y,
                        rs.normal(size=(3, D)).astype("f4"), yt))
    data = to_layout(from_arrays(clients, C), LayoutConfig("bucketed"))
    assert isinstance(data, BucketedFedData) and len(data.buckets) >= 6
    return data


def test_a_round_of_fedcof_on_buckets_holds_its_class_means_once() -> None:
    """Every client in one round (the clients stored by size, so the buckets' parts interleave in
    participant order): the message is the concatenation of the buckets' messages put back in
    order, bit for bit, and exactly one tensor of all the round's means [pairs, D] is made."""
    data = skewed()
    alg = FedCOF(FedCOFConfig())
    init = alg.init(data.spec(), 0)
    part = torch.arange(data.num_clients)
    ctx = RoundCtx(0, 0, part, data.num_clients)
    parts, order = [], []
    for ms, bucket in data.groups():
        fresh = FedCOFClientState(torch.zeros(len(ms), dtype=torch.bool))
        parts.append(alg.client_update(fresh, init.broadcast, bucket, ctx)[1])
        order += ms
    assert order != sorted(order)
    want = put_back(tree_cat(parts), order, data.device)
    Q, D = want.means.shape
    with _Allocations() as seen:
        _, msg = client_updates(alg, FedCOFClientState(init.client_state.sent.clone()), init.broadcast, data, ctx)
    for a, b in zip(tree_leaves(msg), tree_leaves(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert seen.shapes.count((Q, D)) == 1, seen.shapes.count((Q, D))
    # and the run's head is the one from the message put in order (the server's bank is that message)
    res = engine.run(FedCOF(FedCOFConfig()), data, rounds=1, progress=False)
    ss, _ = alg.server_aggregate(init.server_state, want, ctx)
    assert torch.equal(res.server_state.weight, ss.weight) and torch.equal(res.server_state.bank_means, ss.bank_means)


class _PoolAtCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """At every index_copy_ into a tensor of shape `dest`, the bytes the open buffer pool holds."""

    def __init__(self, pool: dict, dest: tuple[int, ...]) -> None:
        super().__init__()
        self.pool, self.dest, self.at_copies, self.most = pool, dest, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        held = sum(b.numel() * b.element_size() for b in self.pool.values())
        self.most = max(self.most, held)
        if func is torch.ops.aten.index_copy_.default and tuple(args[0].shape) == self.dest:
            self.at_copies.append(held)
        return func(*args, **(kwargs or {}))


def test_a_partial_rounds_call_frees_its_scratch_before_its_messages_are_copied(monkeypatch) -> None:
    """LP (no head kept per client) on a bucketed federation, half the clients: the round's calls
    merge several buckets' participants, local training fills the pool, and when each call's
    messages are copied into the round's [P, D, C] stack the pool holds nothing. The run is the
    one with the pool kept, bit for bit (the buffers are scratch, written before they are read)."""
    data = skewed(D=7, C=3)
    fraction = 0.5
    part = select_participants(data.num_clients, fraction, 0, 0)
    calls = list(participant_groups(data, part, regroup=True))
    bucket = {i: b for b, ms in enumerate(data.members) for i in ms}
    assert any(len({bucket[i] for i in ids}) > 1 for ids, _ in calls) and len(calls) > 1
    P = len(part)

    def lp() -> HeadTuning:
        return HeadTuning(LPConfig(local_models=False, batch_size=4))

    with ops.buffer_pool() as pool, _PoolAtCopies(pool, (P, 7, 3)) as spy:  # the engine's run shares this pool
        res = engine.run(lp(), data, rounds=1, fraction=fraction, progress=False)
    assert spy.most > 0 and len(spy.at_copies) == len(calls)
    assert all(h > 0 for h in spy.at_copies), spy.at_copies  # a pool this small is kept
    monkeypatch.setattr(ops, "SCRATCH_KEEP_BYTES", 0)  # as if it were large
    with ops.buffer_pool() as pool, _PoolAtCopies(pool, (P, 7, 3)) as spy:
        res = engine.run(lp(), data, rounds=1, fraction=fraction, progress=False)
    assert spy.at_copies == [0] * len(calls), spy.at_copies
    monkeypatch.setattr(ops, "release_scratch", lambda: None)  # the pool kept through the round, as before
    ref = engine.run(lp(), data, rounds=1, fraction=fraction, progress=False)
    for a, b in zip(tree_leaves((res.client_state, res.server_state)), tree_leaves((ref.client_state, ref.server_state)),
                    strict=True):
        assert torch.equal(a, b)
    assert grouping.ROUND_WASTE is not None  # the merged calls, not the per-bucket grouping


def test_the_evaluated_state_of_a_bucketed_federation_is_made_once() -> None:
    """Per-FedAvg personalises every client for evaluation (adapt_for_eval), bucket by bucket:
    the buckets' personal heads go straight to their places in one [M, ...] state (cat_put_back),
    where concatenating them and reordering the concatenation held every client's head twice.
    Bit for bit the state put_back(tree_cat(...)) gave."""
    from fedheads.algorithms.perfedavg import PerFedAvg, PerFedAvgConfig

    data = skewed(D=7, C=3)
    alg = PerFedAvg(PerFedAvgConfig())
    res = engine.run(alg, data, rounds=1, progress=False)
    parts, order = [], []
    for ms, bucket in data.groups():
        parts.append(alg.adapt_for_eval(tree_rows(res.client_state, ms, data.device), res.server_state, bucket))
        order += ms
    assert order != sorted(order)
    want = put_back(tree_cat(parts), order, data.device)
    leaf = max(tree_leaves(want), key=lambda t: t.numel())
    with _Allocations() as seen:
        got = engine.eval_client_state(alg, res.client_state, res.server_state, data)
    for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert seen.shapes.count(tuple(leaf.shape)) == 1, seen.shapes.count(tuple(leaf.shape))


def test_the_rounds_message_stacks_are_reused_and_never_under_a_state_that_views_them() -> None:
    """A partial round on a bucketed federation copies its calls' messages into one [P, ...]
    stack per leaf; the run's rounds reuse those stacks (made once per run, not per round: a
    fresh 100 x 1.3 MB stack was page-faulted anew every round), and the run is the one without
    the pool, bit for bit; stacks above MESSAGE_KEEP_BYTES are made afresh each round (they would
    sit beside the evaluation and the next round's first call). A server state that keeps a view of
    its message keeps that memory: the engine stops reusing it, so an earlier round's state is
    never overwritten."""
    data = skewed(D=7, C=3)
    fraction = 0.5
    P = len(select_participants(data.num_clients, fraction, 0, 0))

    def fedavg() -> FedAvg:
        return FedAvg(FedAvgConfig(hidden=4, batch_size=4, local_models=False))

    with _Allocations() as seen:
        res = engine.run(fedavg(), data, rounds=4, fraction=fraction, progress=False)
    assert seen.shapes.count((P, 7, 4)) == 1, seen.shapes.count((P, 7, 4))  # the projection's delta stack
    with pytest.MonkeyPatch.context() as mp, _Allocations() as seen:  # stacks above the bound: freed each round
        mp.setattr(engine, "MESSAGE_KEEP_BYTES", 100)
        big = engine.run(fedavg(), data, rounds=4, fraction=fraction, progress=False)
    assert seen.shapes.count((P, 7, 4)) == 4, seen.shapes.count((P, 7, 4))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(res.server_state), tree_leaves(big.server_state),
                                                 strict=True))
    init = fedavg().init(data.spec(), 0)
    ss, bc = init.server_state, init.broadcast
    cs = init.client_state
    for r in range(4):  # the same rounds with a fresh stack each time
        ctx = RoundCtx(r, 0, select_participants(data.num_clients, fraction, 0, r), data.num_clients)
        cs, msg = client_updates(fedavg(), cs, bc, data, ctx, in_place=True)
        ss, bc = fedavg().server_aggregate(ss, msg, ctx)
    for a, b in zip(tree_leaves(res.server_state), tree_leaves(ss), strict=True):
        assert torch.equal(a, b)

    class Keeps(FedAvg):  # a server state that holds its last message stack itself
        def server_aggregate(self, ss, msg, ctx):  # noqa: ANN001, ANN202
            new, bc = super().server_aggregate(ss, msg, ctx)
            return dataclasses.replace(new, opt=msg.delta), bc

    kept = []

    class Spy:
        def load(self, init):  # noqa: ANN001, ANN202
            return None

        def save(self, state):  # noqa: ANN001, ANN202
            kept.append((state.server_state.opt, {k: v.clone() for k, v in state.server_state.opt.items()}))

    engine.run(Keeps(FedAvgConfig(hidden=4, batch_size=4, local_models=False)), data, rounds=3, fraction=fraction,
               progress=False, checkpoint=Spy())
    for held, copy in kept:  # every round's kept stack is as it was when its round ended
        assert all(torch.equal(held[k], copy[k]) for k in copy)
    assert len({held["proj.weight"].data_ptr() for held, _ in kept}) == 3
