"""A round's participants on a bucketed federation of skewed client sizes go through a few stacked
calls, not one per size bucket (fedheads/core/grouping.py), within the padding bound, and the
run is the per-bucket grouping's: the same participants, traffic and accuracies, states equal up
to float rounding (CPU kernels pick their path by the stacked shapes; bit for bit in most cases)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig
from fedheads.algorithms.fedcof import FedCOF
from fedheads.algorithms.fedncm import FedNCM
from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig
from fedheads.algorithms.perfedavg import PerFedAvg, PerFedAvgConfig
from fedheads.core import grouping, run, select_participants
from fedheads.core.engine import participant_groups
from fedheads.core.federation import BucketedFedData, LayoutConfig, to_layout
from fedheads.core.grouping import merge_units
from fedheads.core.tree import tree_leaves
from fedheads.run.load import from_arrays


def skewed_fed(M: int = 40, D: int = 6, C: int = 3, seed: int = 0, views: bool = False) -> BucketedFedData:
    """Power-law client sizes (1 to 120 training rows, 1 to 8 test rows) in the default buckets."""
    rs = np.random.default_rng(seed)
    centers = rs.normal(size=(C, D)) * 2
    sizes = np.minimum((rs.pareto(1.2, M) * 4 + 1).astype(int), 120)
    clients, views_ = [], []
    for i, n in enumerate(sizes):
        classes = rs.choice(C, size=2, replace=False) if i % 2 else np.arange(C)
        y = rs.choice(classes, size=n)
        x = (centers[y] + rs.normal(size=(n, D))).astype("f4")
        yt = rs.choice(classes, size=int(rs.integers(1, 9)))
        clients.append((x, y, (centers[yt] + rs.normal(size=(len(yt), D))).astype("f4"), yt))
        views_.append((x[None] + rs.normal(size=(2, n, D)) * 0.1).astype("f4"))
    data = to_layout(from_arrays(clients, C, train_views=views_ if views else None), LayoutConfig("bucketed"))
    assert isinstance(data, BucketedFedData) and len(data.buckets) >= 15
    return data


def counting(algorithm):  # noqa: ANN001, ANN201
    """`algorithm` with its client_update calls recorded (the round of each call)."""
    calls: list[int] = []
    base = type(algorithm)

    class Counted(base):  # type: ignore[misc, valid-type]
        def client_update(self, cs, bc, data, ctx):  # noqa: ANN001, ANN202
            calls.append(ctx.round)
            return super().client_update(cs, bc, data, ctx)

    algorithm.__class__ = Counted
    return algorithm, calls


ALGOS = {
    "fedavg": lambda: FedAvg(FedAvgConfig(hidden=8, batch_size=4, local_epochs=2)),
    "fedavg-linear": lambda: FedAvg(FedAvgConfig(hidden=0, batch_size=4)),
    "fedpcl-code-views": lambda: FedPCL(FedPCLConfig(hidden=8, batch_size=4, variant="code", noise="gaussian")),
    "perfedavg": lambda: PerFedAvg(PerFedAvgConfig(hidden=8, batch_size=4, alpha=0.05)),  # steps every stacked client
    "fedncm": FedNCM,
    "fedcof": FedCOF,  # RaggedRows messages
}


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_skewed_rounds_take_few_calls_and_equal_one_call_per_bucket(name: str, monkeypatch) -> None:
    data = skewed_fed(views=name == "fedpcl-code-views")
    a, calls = counting(ALGOS[name]())
    # message_budget=None: no dry run of client_update sizing the messages (FedNCM) among the counted calls
    merged = run(a, data, rounds=3, seed=5, fraction=0.3, progress=False, message_budget=None)
    monkeypatch.setattr(grouping, "ROUND_WASTE", None)  # the per-bucket grouping
    b, per_bucket = counting(ALGOS[name]())
    ref = run(b, data, rounds=3, seed=5, fraction=0.3, progress=False, message_budget=None)
    for r in range(3):
        part = set(select_participants(data.num_clients, 0.3, 5, r).tolist())
        holding = sum(1 for ms in data.members if part & set(ms))
        assert per_bucket.count(r) == holding >= 8
        assert calls.count(r) <= 4 < holding
    for ta, tb in zip(tree_leaves((merged.client_state, merged.server_state)),
                      tree_leaves((ref.client_state, ref.server_state)), strict=True):
        torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-6)
    for ha, hb in zip(merged.history, ref.history, strict=True):
        assert ha.participants == hb.participants and ha.comm == hb.comm
        for k in ha.accuracy:
            torch.testing.assert_close(ha.accuracy[k], hb.accuracy[k], equal_nan=True)


def test_merged_groups_keep_the_padding_bound_and_whole_buckets() -> None:
    data = skewed_fed(M=60, seed=1)
    shapes = [(len(ms), g.x_train.shape[1] + g.x_test.shape[1]) for ms, g in data.groups()]
    max_rows = max(grouping.GROUP_BYTES // (4 * data.dim), *(k * n for k, n in shapes))
    max_clients = max(grouping.GROUP_CLIENTS, *(k for k, _ in shapes))
    bucket = {i: b for b, ms in enumerate(data.members) for i in ms}
    for fraction in (0.2, 0.5, 1.0):
        part = select_participants(data.num_clients, fraction, 0, 0)
        groups = list(participant_groups(data, part, regroup=True))
        assert sorted(i for ids, _ in groups for i in ids) == part.tolist()
        assert len(groups) < sum(1 for ms in data.members if set(part.tolist()) & set(ms))
        for ids, sub in groups:
            assert list(sub.n_train) == [data.n_train[i] for i in ids]
            assert list(sub.n_train) == sorted(sub.n_train, reverse=True) or len({bucket[i] for i in ids}) == 1
            real = sum(data.n_train[i] + max(data.n_test[i], 1) for i in ids)
            padded = len(ids) * (sub.x_train.shape[1] + sub.x_test.shape[1])
            assert padded <= (1 + grouping.ROUND_WASTE) * real or len({bucket[i] for i in ids}) == 1
            assert padded <= max_rows and len(ids) <= max_clients
            # every client's rows are its own, whatever call it is stacked in
            for r, i in enumerate(ids):
                one = data.select([i])
                n, t = one.n_train[0], one.n_test[0]
                assert torch.equal(sub.x_train[r, :n], one.x_train[0, :n]) and not sub.m_train[r, n:].any()
                assert torch.equal(sub.y_test[r, :t], one.y_test[0, :t]) and not sub.m_test[r, t:].any()
                assert int(sub.client_index[r]) == int(one.client_index[0])


def test_a_whole_bucket_of_several_clients_keeps_its_own_call() -> None:
    # units: a whole bucket of two clients (sizes 5, 5) between single participants of sizes 4 and 6
    n_train, n_test = [4, 5, 5, 6], [1, 1, 1, 1]
    units, whole = [[0], [1, 2], [3]], [False, True, False]
    assert merge_units(units, whole, n_train, n_test, 100, 10, waste=1.0) == [[0], [1], [2]]
    assert merge_units(units, [False, False, False], n_train, n_test, 100, 10, waste=1.0) == [[0, 1, 2]]
    assert merge_units(units, [False, False, False], n_train, n_test, 100, 10, waste=None) == [[0], [1], [2]]
    # the bounds: twice the real rows (3 x 21 rows > 2 x 25), the largest bucket's rows and clients
    assert merge_units([[0], [1], [2]], [False] * 3, [1, 1, 20], [1, 1, 1], 100, 10, waste=1.0) == [[0, 1], [2]]
    assert merge_units([[0], [1]], [True, True], [8, 10], [1, 1], 21, 10, waste=1.0) == [[0], [1]]  # 22 > 21 rows
    assert merge_units([[0], [1]], [True, True], [8, 10], [1, 1], 22, 1, waste=1.0) == [[0], [1]]  # 2 > 1 client
    assert merge_units([[0], [1]], [True, True], [8, 10], [1, 1], 22, 2, waste=1.0) == [[0, 1]]
    with pytest.raises(ValueError, match="waste"):
        merge_units([[0], [1]], [False, False], [1, 1], [1, 1], 10, 10, waste=-1.0)


class _StateCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes that copy kernels write into tensors whose trailing shape is `tail` (a client's rows
    of one state leaf): gathers and clones (their output), index / slice writes (their source)."""

    WRITTEN = {"index_copy_": 3, "index_put_": 2, "copy_": 1}  # op -> the argument holding what is written
    MADE = ("index_select", "clone", "cat", "gather")

    def __init__(self, tail: tuple[int, ...]) -> None:
        super().__init__()
        self.tail, self.bytes = tail, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        t = args[self.WRITTEN[name]] if name in self.WRITTEN else out if name in self.MADE else None
        if isinstance(t, torch.Tensor) and tuple(t.shape[1:]) == self.tail:
            self.bytes += t.numel() * t.element_size()
        return out


def _round_copies(data: BucketedFedData, algorithm, waste: float | None, monkeypatch) -> tuple[int, int, int]:  # noqa: ANN001
    """(bytes copied into or out of [*, D, H] tensors in a round's client updates, the
    participants, one client's bytes of that leaf), with grouping.ROUND_WASTE = `waste`."""
    from fedheads.core.engine import client_updates, owned
    from fedheads.core.protocol import RoundCtx

    monkeypatch.setattr(grouping, "ROUND_WASTE", waste)
    init = algorithm.init(data.spec(), 0)
    cs = owned(init.client_state, init.server_state, init.broadcast)
    part = select_participants(data.num_clients, 0.3, 5, 1)
    w = cs.params["proj.weight"]
    with _StateCopies(tuple(w.shape[1:])) as seen:
        client_updates(algorithm, cs, init.broadcast, data, RoundCtx(1, 5, part, data.num_clients), in_place=True)
    return seen.bytes, len(part), w[0].numel() * w.element_size()


def test_a_merged_round_copies_each_participants_model_no_more_than_per_bucket_calls(monkeypatch) -> None:
    """FedAvg trains from the broadcast and never reads a participant's stored model: a merged
    call gathers none of them (update_replaces), so a round copies each participant's model once
    into local training, once into its message and once back into the state, as one call per
    bucket does at best (there a single participant's rows are a view)."""
    data = skewed_fed(D=6)
    # one step per client (a batch over the largest client): no call reorders its clients' models
    fedavg = lambda: FedAvg(FedAvgConfig(hidden=16, batch_size=128, batch_norm=False, normalize=False))  # noqa: E731
    merged, P, row = _round_copies(data, fedavg(), 1.0, monkeypatch)
    per_bucket, _, _ = _round_copies(data, fedavg(), None, monkeypatch)
    assert merged == 3 * P * row and merged <= per_bucket


def test_a_merged_group_holds_at_most_group_state_bytes_of_client_state(monkeypatch) -> None:
    """Merged calls allocate tensors of their clients' state size (local training's private copy,
    the messages): a merged group holds at most GROUP_STATE_BYTES of client state; a bucket's
    participants over it keep their own call, as in the per-bucket grouping."""
    data = skewed_fed(M=60, seed=1)
    part = select_participants(data.num_clients, 0.5, 0, 0)
    bucket = {i: b for b, ms in enumerate(data.members) for i in ms}
    assert grouping.max_clients([3, 64, 70], 0) == 70 and grouping.max_clients([3], 1 << 40) == 1
    assert grouping.max_clients([3], grouping.GROUP_STATE_BYTES // 16) == 16
    free = list(participant_groups(data, part, regroup=True, state_bytes=1000))
    monkeypatch.setattr(grouping, "GROUP_STATE_BYTES", 4000)
    capped = list(participant_groups(data, part, regroup=True, state_bytes=1000))
    assert max(len(ids) for ids, _ in free) > 4 and len(capped) > len(free)
    assert sorted(i for ids, _ in capped for i in ids) == part.tolist()
    for ids, _ in capped:
        assert len(ids) <= 4 or len({bucket[i] for i in ids}) == 1
