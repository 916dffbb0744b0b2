"""FedCOF (Goswami et al., NeurIPS 2025): equal to the authors' FedCOFServer/FedCOFClient on the
same features, the covariance estimator exact where it must be, order and grouping invariance,
partial participation, the pseudo-inverse fallback, and the one-line refusal under SecAgg+."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from fedcof_reference import FedCOFClient, FedCOFServer

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms import fedcof as F
from fedheads.algorithms.fed3r import Fed3R, Fed3RConfig
from fedheads.core import engine
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import tree_index
from fedheads.prediction import prototypes as inference
from fedheads.run.load import from_arrays


# ---------------------------------------------------------------- the authors' code (oracle)
# dipamgoswami/FedCOF federate_classes.py: tests/fedcof_reference.py
# ---------------------------------------------------------------- helpers
def federation(seed=0, M=8, C=5, D=4, absent=True):
    """Non-IID clients of different sizes (some with one sample of a class); class C-1 held by
    nobody when `absent`."""
    rng = np.random.default_rng(seed)
    held = C - 1 if absent else C
    clients = []
    for _ in range(M):
        n = int(rng.integers(2, 15))
        y = rng.choice(rng.choice(held, size=min(held, 3), replace=False), size=n)
        x = rng.normal(size=(n, D)) + 2 * np.eye(C, D)[y] + 0.5 * rng.normal(size=D)
        yt = rng.choice(held, size=6)
        xt = rng.normal(size=(6, D)) + 2 * np.eye(C, D)[yt]
        clients.append((x.astype(np.float32), y, xt.astype(np.float32), yt))
    return clients, C


def authors_fedcof(clients, C, gamma):
    stats = {}
    for k, (x, y, _, _) in enumerate(clients):
        cl = FedCOFClient(k, torch.from_numpy(x), torch.from_numpy(y))
        cl.compute()
        stats[k] = cl.send()
    srv = FedCOFServer(stats, C, clients[0][0].shape[1], gamma)
    srv.aggregate()
    return srv.get_classifier_weights()


def ctx(parts, M):
    return RoundCtx(0, 0, torch.as_tensor(parts, dtype=torch.int64), M)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("gamma", [1.0, 0.1])
@pytest.mark.parametrize("eng", engine.ENGINES)
def test_equals_the_authors_fedcof(eng, gamma):
    clients, C = federation()
    data = from_arrays(clients, C)
    res = engine.run(F.FedCOF(F.FedCOFConfig(gamma=gamma)), data, rounds=1, engine=eng, progress=False)
    ref = authors_fedcof(clients, C, gamma)  # [C, D] float32, pinv in float32
    ss = res.server_state
    np.testing.assert_allclose(ss.weight[:C - 1].numpy(), ref[:C - 1].numpy(), rtol=0, atol=2e-5)
    assert torch.equal(ss.weight[C - 1], torch.zeros(4, dtype=torch.float64)) and not bool(ss.present[C - 1])
    assert not bool(ss.pinv)
    # the authors' prediction x W^T argmax is ours
    scores = F.FedCOF().predict(res.client_state, ss, data.x_test, data.m_test)["main"]
    ours, theirs = scores.argmax(-1), (data.x_test @ ref.T)[..., :C - 1].argmax(-1)
    assert torch.equal(ours[data.m_test], theirs[data.m_test])


def test_one_sample_per_client_class_and_between_class_scatter_give_the_exact_gram():
    """With one sample per (client, class) the client means ARE the samples, so the unbiased
    estimator is the sample covariance exactly; with the between-class scatter added back and
    gamma = 0, G is X^T X and FedCOF's classifier is Fed3R's (no bias column, lambda = 0)."""
    rng = np.random.default_rng(3)
    C, D = 3, 4
    clients = []
    for k in range(12):
        y = np.array([k % C])
        x = (rng.normal(size=(1, D)) + 2 * np.eye(C, D)[y]).astype(np.float32)
        clients.append((x, y, x, y))
    data = from_arrays(clients, C)
    cof = engine.run(F.FedCOF(F.FedCOFConfig(gamma=0.0, between_class=True)), data, rounds=1, progress=False)
    ridge = engine.run(Fed3R(Fed3RConfig(bias=False, lam=0.0)), data, rounds=1, progress=False)
    X = np.concatenate([c[0] for c in clients]).astype(np.float64)
    ss = cof.server_state
    g, _, _ = F.estimated_gram(ss.bank_means[ss.bank_count > 0], ss.bank_class[ss.bank_count > 0],
                               ss.bank_count[ss.bank_count > 0], C, 0.0, True)
    np.testing.assert_allclose(g.numpy(), X.T @ X, rtol=0, atol=1e-10)
    torch.testing.assert_close(ss.weight, ridge.server_state.weight, rtol=0, atol=1e-10)
    # within-class only (the paper's choice) is a different matrix
    g2, _, _ = F.estimated_gram(ss.bank_means[:12], ss.bank_class[:12], ss.bank_count[:12], C, 0.0, False)
    assert not np.allclose(g2.numpy(), X.T @ X)


@pytest.mark.parametrize("eng", engine.ENGINES)
def test_any_order_and_grouping_of_clients_gives_the_same_head(eng):
    clients, C = federation(seed=1, M=7)
    base = engine.run(F.FedCOF(), from_arrays(clients, C), rounds=1, engine=eng, progress=False)
    perm = [6, 2, 0, 5, 3, 1, 4]
    other = engine.run(F.FedCOF(), from_arrays([clients[i] for i in perm], C), rounds=1, engine=eng,
                       progress=False)
    torch.testing.assert_close(base.server_state.weight, other.server_state.weight, rtol=0, atol=1e-12)
    alg = F.FedCOF()
    data = from_arrays(clients, C)
    init = alg.init(data.spec(), 0)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(7), 7))
    ss = init.server_state
    for g in ([5, 1], [3], [0, 2, 4, 6]):
        ss, _ = alg.server_aggregate(ss, tree_index(msg, torch.tensor(g)), ctx(g, 7))
    assert torch.equal(ss.weight, base.server_state.weight)  # the bank is summed in slot order: bit for bit


def test_partial_participation_reaches_the_full_head():
    clients, C = federation(seed=2, M=6)
    data = from_arrays(clients, C)
    full = engine.run(F.FedCOF(), data, rounds=1, progress=False)
    part = engine.run(F.FedCOF(), data, rounds=12, fraction=0.5, progress=False)
    seen = set().union(*(r.participants for r in part.history))
    assert seen == set(range(6))
    assert torch.equal(part.server_state.weight, full.server_state.weight)
    first = part.history[0]
    assert len(first.participants) == 3 and first.accuracy is not None
    # each sends the mean, label and count of the classes it holds (not C x D), and only once
    held = [len(set(clients[k][1].tolist())) for k in range(6)]
    assert first.comm.up_values == sum(held[k] for k in first.participants) * (4 + 2)
    sent: set[int] = set()
    for r in part.history:
        fresh = [k for k in r.participants if k not in sent]
        assert abs(r.comm.up_values - sum(held[k] for k in fresh) * 6) <= len(r.participants) / 2  # rounded mean
        sent |= set(r.participants)


def test_secagg_is_refused_in_one_line_naming_why_and_the_cost(tmp_path):
    clients, C = federation()
    data = from_arrays(clients, C)
    alg = F.FedCOF()
    init = alg.init(data.spec(), 0)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(8), 8))
    with pytest.raises(UserError) as e:
        alg.secure_form(tree_index(msg, torch.tensor([0])))
    line = str(e.value)
    assert "\n" not in line and "each client's class means" in line and "D² = 16 per class" in line
    with pytest.raises(UserError, match="C·D² values per client"):
        alg.secure_form()
    from fedheads.privacy import Mechanism, Private

    with pytest.raises(UserError, match="dp: fedcof has no differentially private form"):  # its means are no sums
        Private(alg, Mechanism(epsilon=1.0))
    pytest.importorskip("flwr")
    from flower_helpers import write_store

    from fedheads.flower.server import FlowerRunConfig
    from fedheads.flower.sim import simulate_store

    with pytest.raises(UserError, match="secagg: fedcof needs each client's class means"):
        simulate_store(FlowerRunConfig(algorithm="fedcof", backbones="synth", rounds=1, timeout=60, secagg=True),
                       write_store(tmp_path))


def test_pseudo_inverse_fallback_is_said_and_flagged(caplog):
    """gamma = 0 and one sample per class: G = N g g^T has rank one."""
    clients = [(np.array([[1.0, 0.0, 0.5]], dtype=np.float32), np.array([0]),
                np.array([[1.0, 0.0, 0.5]], dtype=np.float32), np.array([0])),
               (np.array([[0.0, 1.0, 0.5]], dtype=np.float32), np.array([1]),
                np.array([[0.0, 1.0, 0.5]], dtype=np.float32), np.array([1]))]
    data = from_arrays(clients, 2)
    with caplog.at_level(logging.WARNING, logger="fedheads.algorithms.fed3r"):
        res = engine.run(F.FedCOF(F.FedCOFConfig(gamma=0.0)), data, rounds=1, progress=False)
    assert bool(res.server_state.pinv) and "fedcof" in caplog.text and "pseudo-inverse" in caplog.text
    # gamma > 0 alone does not help here: the shrinkage is weighted by N_c - 1 = 0
    assert bool(engine.run(F.FedCOF(), data, rounds=1, progress=False).server_state.pinv)
    clients, C = federation(seed=5)
    assert not bool(engine.run(F.FedCOF(), from_arrays(clients, C), rounds=1, progress=False).server_state.pinv)


def test_linear_head_prototype_view_registry_and_errors():
    clients, C = federation(seed=4)
    data = from_arrays(clients, C)
    alg = create_algorithm("fedcof", gamma=0.5)
    assert isinstance(alg, F.FedCOF) and alg.cfg.gamma == 0.5
    res = engine.run(alg, data, rounds=1, progress=False)
    ss = res.server_state
    head = alg.linear_head(ss)
    assert head["cls.weight"].shape == (4, C) and torch.equal(head["cls.bias"], torch.zeros(C))
    scores = alg.predict(res.client_state, ss, data.x_test, data.m_test)["main"]
    assert torch.equal((data.x_test @ head["cls.weight"])[..., ss.present].argmax(-1),
                       scores[..., ss.present].argmax(-1))
    q, protos, pres, how = alg.prototype_view(res.client_state, ss, data.x_test[:1])
    pred = inference.predict_features(protos[0].numpy(), pres[0].numpy(), how, q[0].numpy())
    np.testing.assert_array_equal(scores[0].argmax(-1).numpy(), pred.labels)
    assert res.trainable_params_per_client == 0
    with pytest.raises(UserError, match="gamma=-1"):
        create_algorithm("fedcof", gamma=-1)
    r64 = engine.run(create_algorithm("fedcof"), data, rounds=1, progress=False)
    r32 = engine.run(create_algorithm("fedcof", dtype="float32"), data, rounds=1, progress=False)
    torch.testing.assert_close(r32.server_state.weight, r64.server_state.weight, rtol=0, atol=1e-5)
    assert r32.total_comm().up_bytes < r64.total_comm().up_bytes
    # a client whose message holds more classes than its declared size cannot be placed
    spec = data.spec()
    small = type(spec)(spec.dim, spec.num_classes, spec.num_clients, (1,) * spec.num_clients, spec.device)
    init = alg.init(small, 0)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(8), 8))
    with pytest.raises(UserError, match="more classes than it has training samples"):
        alg.server_aggregate(init.server_state, msg, ctx(range(8), 8))


def test_flower_simulation_equals_the_engine(tmp_path):
    """Without SecAgg+ FedCOF runs over Flower as on the loop engine, bit for bit (the server's
    bank is sized from the nodes' reported sample counts)."""
    pytest.importorskip("flwr")
    from flower_helpers import write_store

    from fedheads.core.tree import tree_leaves
    from fedheads.flower.server import FlowerRunConfig
    from fedheads.flower.sim import simulate_store
    from fedheads.run.load import load_fed_data

    store = write_store(tmp_path)
    out = simulate_store(FlowerRunConfig(algorithm="fedcof", backbones="synth", rounds=2, fraction=0.67,
                                         timeout=120, seed=1), store)
    ref = engine.run(F.FedCOF(), load_fed_data(store, ["synth"], "cpu"), 2, seed=1, fraction=0.67,
                     engine="loop", progress=False)
    for got, want in zip(tree_leaves(out["server_state"]), tree_leaves(ref.server_state)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_engine_keeps_the_data_order_for_fedcof_whose_bank_follows_positions():
    """FedCOF's bank rows name client positions, which no row permutation puts back: it
    declares server_client_fields = None, so an engine allowed to reorder runs it as given and
    the saved bank is in the data's order (bitwise equal to an unordered run)."""
    from fedheads.core.order import stacking_order

    rng = np.random.default_rng(5)
    clients = [(rng.normal(size=(n, 6)).astype("f4"), rng.integers(0, 3, n), rng.normal(size=(2, 6)).astype("f4"),
                rng.integers(0, 3, 2)) for n in (3, 9, 5, 12)]
    data = from_arrays(clients, 3)
    alg = create_algorithm("fedcof")
    assert stacking_order(alg, data, 1.0, "vectorized") is None
    assert stacking_order(create_algorithm("fedncm"), data, 1.0, "vectorized") is not None  # uneven sizes: reordered
    a = engine.run(alg, data, 1, progress=False, reorder=True)
    b = engine.run(alg, data, 1, progress=False)
    for f in ("bank_means", "bank_class", "bank_count", "weight"):
        assert torch.equal(getattr(a.server_state, f), getattr(b.server_state, f)), f


# ---------------------------------------------------------------- compact messages
def test_messages_hold_only_the_classes_each_client_has_bit_for_bit_fedncms_sums():
    """A client sends the means of the classes it holds, not a [C, D] block: the message grows
    with the (client, class) pairs, and each sum is client_stats' dense one bit for bit."""
    from fedheads.algorithms.fedncm import client_stats

    clients, _ = federation(seed=6, M=9, C=5, D=4)
    C = 400  # many classes nobody holds
    data = from_arrays(clients, C)
    alg = F.FedCOF()
    init = alg.init(data.spec(), 0)
    cs, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(9), 9))
    held = [sorted(set(c[1].tolist())) for c in clients]
    assert msg.pairs.tolist() == [len(h) for h in held]
    assert msg.classes.tolist() == [c for h in held for c in h] and msg.means.shape == (sum(map(len, held)), 4)
    sums, counts = client_stats(data.x_train, data.y_train, data.m_train, C)
    k = torch.repeat_interleave(torch.arange(9), msg.pairs)
    assert torch.equal(msg.counts, counts[k, msg.classes])
    assert torch.equal(msg.means, sums[k, msg.classes] / counts[k, msg.classes].unsqueeze(1).to(torch.float64))
    values, nbytes = msg.comm_size()
    assert values == round(len(k) * (4 + 2) / 9) and nbytes == round(len(k) * (4 * 8 + 16) / 9) and values < C
    # once sent, a client sends nothing
    _, again = alg.client_update(cs, init.broadcast, data, ctx(range(9), 9))
    assert again.pairs.tolist() == [0] * 9 and again.means.shape == (0, 4) and again.comm_size() == (0, 0)


def test_ragged_messages_concatenate_select_and_reorder_as_stacked_rows():
    """FedCOFMessage is a RaggedRows tree: per-client messages concatenated are the stacked one,
    selecting clients takes their runs, and the server places any grouping of them identically."""
    from fedheads.core.tree import RaggedRows, tree_cat, tree_leaves, tree_rows

    clients, C = federation(seed=7, M=6)
    data = from_arrays(clients, C)
    alg = F.FedCOF()
    init = alg.init(data.spec(), 0)
    _, whole = alg.client_update(init.client_state, init.broadcast, data, ctx(range(6), 6))
    assert isinstance(whole, RaggedRows)
    one = [alg.client_update(tree_index(init.client_state, torch.tensor([k])), init.broadcast, data.select([k]),
                             ctx([k], 6))[1] for k in range(6)]
    perm = [4, 0, 5, 2]
    for got, want in ((tree_cat(one), whole), (tree_index(whole, torch.tensor(perm)), tree_cat([one[k] for k in perm])),
                      (tree_rows(whole, [1, 2, 3]), tree_cat(one[1:4]))):
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(got), tree_leaves(want)))
    ref, _ = alg.server_aggregate(init.server_state, whole, ctx(range(6), 6))
    ss = init.server_state
    for g in ([3, 1, 5], [0], [2, 4]):  # any order of participants, their rows in that order
        ss, _ = alg.server_aggregate(ss, tree_index(whole, torch.tensor(g)), ctx(g, 6))
    for f in ("bank_means", "bank_class", "bank_count", "weight"):
        assert torch.equal(getattr(ss, f), getattr(ref, f)), f


@pytest.mark.parametrize("eng", engine.ENGINES)
def test_size_buckets_give_the_padded_head_bit_for_bit(eng):
    """Buckets that interleave the client order: their messages, of different sizes, are
    concatenated and put back in client order (core/tree.py RaggedRows) before the server step."""
    from fedheads.core.federation import BucketedFedData, LayoutConfig, to_layout
    from fedheads.core.tree import tree_leaves

    clients, C = federation(seed=8, M=10)
    padded = from_arrays(clients, C)
    buckets = to_layout(padded, LayoutConfig("bucketed", waste=1.0, bucket_clients=3))
    assert isinstance(buckets, BucketedFedData) and [i for ms in buckets.members for i in ms] != list(range(10))
    for frac, rounds in ((1.0, 1), (0.4, 5)):
        a = engine.run(F.FedCOF(), padded, rounds, seed=2, fraction=frac, engine=eng, progress=False)
        b = engine.run(F.FedCOF(), buckets, rounds, seed=2, fraction=frac, progress=False)
        assert all(torch.equal(x, y) for x, y in zip(tree_leaves(a.server_state), tree_leaves(b.server_state)))
        assert [r.comm for r in a.history] == [r.comm for r in b.history]


def test_malformed_messages_are_refused_in_one_line():
    clients, C = federation(seed=9, M=3)
    data = from_arrays(clients, C)
    alg = F.FedCOF()
    init = alg.init(data.spec(), 0)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(3), 3))
    ss = init.server_state

    def bad(**kw):
        return dataclasses.replace(msg, **kw)

    cls = msg.classes.clone()
    cls[-1] = C
    with pytest.raises(UserError, match=f"client 2 sent class {C} with count"):
        alg.server_aggregate(ss, bad(classes=cls), ctx(range(3), 3))
    cnt = msg.counts.clone()
    cnt[0] = 0
    with pytest.raises(UserError, match="client 0 sent class .* with count 0"):
        alg.server_aggregate(ss, bad(counts=cnt), ctx(range(3), 3))
    assert int(msg.pairs[0]) >= 2
    cls = msg.classes.clone()
    cls[1] = cls[0]
    with pytest.raises(UserError, match="client 0 sent class .* twice or out of ascending order"):
        alg.server_aggregate(ss, bad(classes=cls), ctx(range(3), 3))
    with pytest.raises(UserError, match="a message of 3 clients .* for 2 participants"):
        alg.server_aggregate(ss, msg, ctx([0, 1], 3))


def test_the_spread_formed_in_blocks_is_the_same_gram_and_leaves_the_means(monkeypatch):
    """estimated_gram forms the sums and μ_kc − μ_c a block of rows at a time, reading the bank
    and never writing it: the sums and counts are one index_add's bit for bit, the Gram is the
    whole product's up to the order its blocks are added in."""
    g = torch.Generator().manual_seed(0)
    means = torch.randn(50, 6, dtype=torch.float64, generator=g)
    cls = torch.randint(0, 4, (50,), generator=g)
    n = torch.randint(1, 5, (50,), generator=g)
    whole = F.estimated_gram(means, cls, n, 4, 0.5)
    monkeypatch.setattr(F, "SPREAD_ROWS", 7)
    copy = means.clone()
    got = F.estimated_gram(copy, cls, n, 4, 0.5)
    assert torch.equal(got[1], whole[1]) and torch.equal(got[2], whole[2]) and torch.equal(copy, means)
    torch.testing.assert_close(got[0], whole[0], rtol=1e-13, atol=0)
    mu = whole[1] / whole[2].clamp(min=1).unsqueeze(1).to(torch.float64)
    d = means - mu[cls]
    w = n * (whole[2] - 1).to(torch.float64)[cls] / (torch.bincount(cls, minlength=4) - 1).clamp(min=1)[cls]
    g_ = (d * w.unsqueeze(1)).T @ d + 0.5 * float((whole[2] - 1).clamp(min=0).sum()) * torch.eye(6, dtype=torch.float64)
    s = whole[1].sum(0, keepdim=True)
    torch.testing.assert_close(got[0], g_ + s.T @ s / float(n.sum()), rtol=1e-12, atol=0)


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The shapes of the new tensors ops return while active (not an in-place op's own input)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in given:
                self.shapes.append(tuple(t.shape))
        return out


def test_the_server_holds_one_bank_of_the_pairs_received_and_forms_the_gram_in_blocks(monkeypatch):
    """Memory at scale: the bank has one row per (client, class) pair received, none per sample
    or class slot, and none at init; a round that brings every client makes no [pairs, D] tensor
    at all (the message's means are the bank, the spread is formed SPREAD_ROWS rows at a time),
    and a later round that brings more makes exactly one (the merged bank), never a second bank
    or a whole spread beside it."""
    clients, C = federation(seed=10, M=9)  # C = 5 classes, D = 4

    def bank_sized(shapes):  # [rows, D] tensors of more rows than a block, a class table or a Gram
        return [s for s in shapes if len(s) == 2 and s[0] > 5 and s[1] == 4]

    data = from_arrays(clients, C)
    alg = F.FedCOF()
    init = alg.init(data.spec(), 0)
    assert init.server_state.bank_means.shape == (0, 4)  # nothing held before anything is received
    monkeypatch.setattr(F, "SPREAD_ROWS", 3)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(9), 9))
    Q = msg.means.shape[0]
    assert Q > 3 * 3 and Q < sum(len(c[1]) for c in clients)
    with _Allocations() as seen:
        ss, _ = alg.server_aggregate(init.server_state, msg, ctx(range(9), 9))
    assert ss.bank_means.shape == (Q, 4) and ss.bank_means.data_ptr() == msg.means.data_ptr()
    assert not bank_sized(seen.shapes), seen.shapes
    ss0, first, later = init.server_state, [0, 2, 3, 7], [1, 4, 5, 6, 8]
    ss0, _ = alg.server_aggregate(ss0, tree_index(msg, torch.tensor(first)), ctx(first, 9))
    rest = tree_index(msg, torch.tensor(later))
    with _Allocations() as seen:
        ss1, _ = alg.server_aggregate(ss0, rest, ctx(later, 9))
    assert bank_sized(seen.shapes) == [(Q, 4)]
    for f in ("bank_means", "bank_client", "bank_class", "bank_count", "sums", "counts", "weight"):
        assert torch.equal(getattr(ss1, f), getattr(ss, f)), f


def test_float32_means_stay_float32_in_the_bank_and_give_the_widened_head_bit_for_bit(monkeypatch):
    """dtype="float32": the server keeps the means in the dtype they are sent in (half a float64
    bank; a one-round run holds the message's own tensor, no float64 copy of it), and forms the
    sums, spread and Gram in float64 a block at a time, so the head is bit for bit the one from
    the same means widened to float64 first; a later round merges float32 rows alike."""
    clients, C = federation(seed=11, M=9)
    data = from_arrays(clients, C)
    alg32, alg64 = F.FedCOF(F.FedCOFConfig(dtype="float32")), F.FedCOF()
    init32, init64 = alg32.init(data.spec(), 0), alg64.init(data.spec(), 0)
    assert init32.server_state.bank_means.dtype == torch.float32
    _, msg = alg32.client_update(init32.client_state, init32.broadcast, data, ctx(range(9), 9))
    assert msg.means.dtype == torch.float32
    wide = dataclasses.replace(msg, means=msg.means.to(torch.float64))
    monkeypatch.setattr(F, "SPREAD_ROWS", 3)
    with _Allocations() as seen:
        ss32, _ = alg32.server_aggregate(init32.server_state, msg, ctx(range(9), 9))
    Q = msg.means.shape[0]
    assert ss32.bank_means.dtype == torch.float32 and ss32.bank_means.data_ptr() == msg.means.data_ptr()
    assert (Q, 4) not in seen.shapes, seen.shapes
    ss64, _ = alg64.server_aggregate(init64.server_state, wide, ctx(range(9), 9))
    for f in ("sums", "counts", "weight", "present"):
        assert torch.equal(getattr(ss32, f), getattr(ss64, f)), f
    first, later = [0, 2, 3, 7], [1, 4, 5, 6, 8]
    a32, _ = alg32.server_aggregate(init32.server_state, tree_index(msg, torch.tensor(first)), ctx(first, 9))
    a32, _ = alg32.server_aggregate(a32, tree_index(msg, torch.tensor(later)), ctx(later, 9))
    a64, _ = alg64.server_aggregate(init64.server_state, tree_index(wide, torch.tensor(first)), ctx(first, 9))
    a64, _ = alg64.server_aggregate(a64, tree_index(wide, torch.tensor(later)), ctx(later, 9))
    assert a32.bank_means.dtype == torch.float32 and torch.equal(a32.bank_means.to(torch.float64), a64.bank_means)
    for f in ("sums", "counts", "weight"):
        assert torch.equal(getattr(a32, f), getattr(a64, f)), f


def test_the_client_step_makes_its_class_means_as_one_tensor():
    """The means are the float64 sums divided in place: one [pairs, D] tensor per client step,
    where dividing into a new tensor held the sums and the means side by side (at 9,275 clients,
    two copies of every client's means). Same values as the plain division."""
    clients, C = federation(seed=12, M=9)
    data = from_arrays(clients, C)
    alg = F.FedCOF()
    init = alg.init(data.spec(), 0)
    with _Allocations() as seen:
        _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(9), 9))
    Q, D = msg.means.shape
    assert seen.shapes.count((Q, D)) == 1, seen.shapes
    pairs, sums, _, counts = F.pair_stats(data.x_train, data.y_train, data.m_train, C)
    assert torch.equal(msg.means, sums / counts.unsqueeze(-1).to(sums.dtype))


def test_scores_are_one_tensor_of_classes_per_prediction():
    """class_scores (Fed3R, FedCOF, FedNCM's linear rule) adds the bias and masks absent classes
    in place: one [rows, C] tensor is made, not three (at 1,203 classes a group's scores are
    larger than its features); the values are those of the out-of-place expression."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 7, 4, generator=g), torch.randn(5, 4, dtype=torch.float64, generator=g), torch.randn(5)
    present = torch.tensor([True, False, True, True, False])
    with _Allocations() as seen:
        s = F.class_scores(w, b, present, x)
    assert len([sh for sh in seen.shapes if sh[-1] == 5 and np.prod(sh) == 70]) == 1, seen.shapes  # [14, 5] or [2, 7, 5]
    want = (x.double() @ w.T + b.double()).masked_fill(~present, float("-inf"))
    assert torch.equal(s, want)
