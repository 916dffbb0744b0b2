"""Algorithms whose server step reads only the sum of the messages (`sums_messages`: FedNCM,
Fed3R) are run by the vectorised engine group by group once the participants' messages would
pass its memory budget: the same head (up to the order of float64 additions), the same traffic
counted, and never more than one group's messages held."""

from __future__ import annotations

import pytest
import torch
from fed_tiny import tiny_fed

from fedheads.algorithms import create_algorithm
from fedheads.core import engine
from fedheads.core.federation import LayoutConfig, to_layout
from fedheads.core.protocol import AlgorithmBase
from fedheads.core.tree import tree_leaves


def _plain(name: str) -> AlgorithmBase:
    """The algorithm with the protocol's default summed_update (client_update, then the sum)."""
    alg = create_algorithm(name)
    return type(f"Default{type(alg).__name__}", (type(alg),), {"summed_update": AlgorithmBase.summed_update})(alg.cfg)


@pytest.mark.parametrize("name", ["fedncm", "fed3r"])
@pytest.mark.parametrize("layout", ["padded", "bucketed"])
@pytest.mark.parametrize("fraction,rounds", [(1.0, 1), (0.5, 4)])
@pytest.mark.parametrize("fused", [True, False])
def test_summing_group_by_group_gives_the_same_head(name, layout, fraction, rounds, fused, monkeypatch):
    data = tiny_fed(M=7, seed=4)
    if layout == "bucketed":
        data = to_layout(data, LayoutConfig("bucketed", waste=0.0, bucket_clients=2))
        assert len(data.groups()) > 1
    ref = engine.run(create_algorithm(name), data, rounds, fraction=fraction, progress=False, message_budget=None)
    alg = create_algorithm(name) if fused else _plain(name)
    rows: list[int] = []
    aggregate = type(alg).server_aggregate
    monkeypatch.setattr(type(alg), "server_aggregate",
                        lambda self, ss, msg, ctx: rows.append(tree_leaves(msg)[0].shape[0]) or aggregate(self, ss, msg, ctx))
    res = engine.run(alg, data, rounds, fraction=fraction, progress=False, message_budget=1)  # 1 byte: always group
    assert rows == [1] * rounds  # one row, the sum, reaches the server
    for a, b in zip(tree_leaves(res.server_state), tree_leaves(ref.server_state)):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        else:
            assert torch.equal(a, b)
    assert torch.equal(res.final_accuracy(), ref.final_accuracy())
    assert [r.comm for r in res.history] == [r.comm for r in ref.history]  # the traffic of every client, counted


def test_messages_within_the_budget_are_held_as_before():
    """Under the budget the engine stacks every message, as it always did: the state is bitwise
    that of a run without a budget."""
    data = tiny_fed(M=5)
    a = engine.run(create_algorithm("fedncm"), data, 1, progress=False)
    b = engine.run(create_algorithm("fedncm"), data, 1, progress=False, message_budget=None)
    assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a.server_state), tree_leaves(b.server_state)))


def test_group_sizes_follow_the_budget():
    fedncm, plain = create_algorithm("fedncm"), _plain("fedncm")
    assert engine.summing_group(fedncm, 100, 10, 10_000) is None  # 1,000 bytes fit
    assert engine.summing_group(fedncm, 100, 10, 500) == 10  # its own summed_update: whole groups
    assert engine.summing_group(plain, 100, 10, 500) == 5  # the default: 5 messages at a time
    assert engine.summing_group(create_algorithm("fedavg"), 100, 10, 500) is None  # not a sum


@pytest.mark.parametrize("size,views", [(None, False), (1, True), (2, True), (3, False)])
def test_one_walk_hands_out_every_participant_once(size, views):
    """client_updates and summed_updates share participant_groups: every participant once, in the
    layout's group order, at most `size` at a time, each run with its own clients' data; the hook
    runs after each group holding participants, when the caller has dropped that group's data."""
    import weakref

    data = to_layout(tiny_fed(M=7, seed=4), LayoutConfig("bucketed", waste=0.0, bucket_clients=2))
    part = torch.tensor([0, 2, 3, 5, 6])
    held: list[tuple[weakref.ref, bool]] = []  # the data handed out, and whether it is a whole group
    hooks: list[bool] = []
    walked: list[int] = []
    for ids, sub in engine.participant_groups(data, part, size, views=views,
                                              between_buckets=lambda: hooks.append(held[-1][0]() is None or held[-1][1])):
        assert 0 < len(ids) <= (size or len(ids))
        assert sub.client_index.tolist() == data.select(ids).client_index.tolist()
        walked += ids
        held.append((weakref.ref(sub), any(sub is g for _, g in data.groups())))
        del sub
    in_order = [i for ms, _ in data.groups() for i in ms if i in set(part.tolist())]
    assert walked == in_order
    assert not all(whole for _, whole in held)  # some copies or views were freed before the hook
    assert hooks == [True] * sum(any(i in set(part.tolist()) for i in ms) for ms, _ in data.groups())


@pytest.mark.parametrize("name", ["fedavg", "lp", "fedrep"])
def test_partial_rounds_write_participants_rows_in_place(name):
    """A padded federation's client state (a model per client for these) is owned by the run and
    updated in place under partial participation: the same storage every round, no federation-
    sized copy per round; the loop engine (a copy per round) ends at the same state."""
    data = tiny_fed(M=8, seed=2)
    ptrs: list[list[int]] = []

    class Watch:
        def load(self, init):  # noqa: ANN001, ANN202
            return None

        def save(self, state):  # noqa: ANN001, ANN202
            ptrs.append([t.data_ptr() for t in tree_leaves(state.client_state) if t.numel() > 1])

    res = engine.run(create_algorithm(name), data, 4, fraction=0.5, progress=False, checkpoint=Watch())
    ref = engine.run(create_algorithm(name), data, 4, fraction=0.5, progress=False, engine="loop")
    assert ptrs[0] and all(p == ptrs[0] for p in ptrs[1:])
    for a, b in zip(tree_leaves((res.client_state, res.server_state)), tree_leaves((ref.client_state, ref.server_state))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
