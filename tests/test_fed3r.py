"""Fed3R (Fanì et al., ICML 2024): equal to the authors' code on the same features, invariant to
the order and grouping of clients, partial participation, the SecAgg+ form, the pseudo-inverse
fallback, and the linear head it hands to fine-tuning."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from fedcof_reference import Fed3RClient, Fed3RServer

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms import fed3r as F
from fedheads.algorithms.fedncm import FedNCM
from fedheads.core import engine
from fedheads.core.config import setting_doc
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import tree_cat, tree_index
from fedheads.prediction import prototypes as inference
from fedheads.run.load import from_arrays


# ---------------------------------------------------------------- the authors' code (oracle)
# Erosinho13/Fed3R src/fed3r.py, transcribed verbatim (calc_ridge_params, normalize_W, fed3r_step)
def calc_ridge_params(A, b):
    W = torch.linalg.solve(A, b)
    bias = W[-1, :]
    W = W[:-1, :]
    return W, bias


def normalize_W(W, bias, warnings=True):
    norm = torch.norm(W, dim=0, keepdim=True)
    if torch.any(norm == 0.0):
        if warnings:
            print("WARNING: 0 encountered in norm, substituting with 1e-6")
        norm[norm == 0.0] = 1e-6
    W = W / norm
    bias = bias / norm[0, :]
    return W, bias


def fed3r_step(A, b, dataloader, model, num_classes, device):

    for batch_idx, (data, target) in enumerate(dataloader):  # noqa: B007

        data, target = data.to(device), target.to(device)
        try:
            features, _ = model(data, return_feats=True)
        except:  # noqa: E722
            features = model(data)
        feats_with_bias = torch.cat((features, torch.ones((features.shape[0], 1), dtype=torch.float32).to(device)),
                                    dim=1)
        feats_with_bias = feats_with_bias.detach()
        feats_with_bias.requires_grad = False
        one_hot_encoded = torch.nn.functional.one_hot(target, num_classes=num_classes)
        one_hot_encoded = one_hot_encoded.float()
        one_hot_encoded.requires_grad = False
        Ak = feats_with_bias.T @ feats_with_bias
        bk = feats_with_bias.T @ one_hot_encoded
        A += Ak
        b += bk

    return A, b


# dipamgoswami/FedCOF federate_classes.py: tests/fedcof_reference.py
# ---------------------------------------------------------------- helpers
def federation(seed=0, M=5, C=6, D=5, dyadic=False):
    """Non-IID clients of different sizes, a per-client shift; class 5 held by nobody. With
    `dyadic`, features are multiples of 1/4 in [-4, 4]: the authors' float32 Grams are then exact."""
    rng = np.random.default_rng(seed)
    clients = []
    for k in range(M):
        n = int(rng.integers(4, 25))
        y = rng.choice([0, 1, 2, 3, 4] if k == 2 else [0, 1, 2, 3], size=n)
        x = rng.normal(size=(n, D)) + 2 * np.eye(C, D)[y] + 0.3 * k
        if dyadic:
            x = np.clip(np.round(4 * x), -16, 16) / 4
        yt = rng.choice([0, 1, 2, 3], size=7)
        xt = rng.normal(size=(7, D)) + 2 * np.eye(C, D)[yt] + 0.3 * k
        clients.append((x.astype(np.float32), y, xt.astype(np.float32), yt))
    return clients, C


def authors_fed3r(clients, C, lam, batch=4):
    """Erosinho13/Fed3R's main loop: A = lambda I, b = 0, fed3r_step per client, then solve + normalise."""
    D = clients[0][0].shape[1]
    A = lam * torch.eye(D + 1, dtype=torch.float64)  # float64 accumulators: the float32 batch Grams add exactly
    b = torch.zeros(D + 1, C, dtype=torch.float64)
    for x, y, _, _ in clients:
        loader = [(torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch])) for i in range(0, len(y), batch)]
        A, b = fed3r_step(A, b, loader, lambda data: data, C, "cpu")
    W, bias = calc_ridge_params(A, b)
    return normalize_W(W, bias, warnings=False)


def ctx(parts, M):
    return RoundCtx(0, 0, torch.as_tensor(parts, dtype=torch.int64), M)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("eng", engine.ENGINES)
def test_equals_the_authors_fed3r(eng):
    """Dyadic features: the authors' float32 Grams are exact, so the heads agree to float64 solves."""
    clients, C = federation(dyadic=True)
    data = from_arrays(clients, C)
    res = engine.run(F.Fed3R(F.Fed3RConfig(lam=0.01)), data, rounds=1, engine=eng, progress=False)
    ss = res.server_state
    W, bias = authors_fed3r(clients, C, 0.01)
    np.testing.assert_allclose(ss.weight.T.numpy(), W.numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(ss.bias.numpy(), bias.numpy(), rtol=0, atol=1e-10)
    assert ss.present.tolist() == [True] * 5 + [False] and not bool(ss.pinv)
    # the authors' prediction, x W + bias, is ours ("main"), absent class aside
    scores = F.Fed3R().predict(res.client_state, ss, data.x_test, data.m_test)["main"]
    ref = data.x_test.double() @ W + bias
    np.testing.assert_allclose(scores[..., :5].numpy(), ref[..., :5].numpy(), rtol=0, atol=1e-9)
    assert torch.isinf(scores[..., 5]).all()


def test_equals_the_authors_fed3r_on_gaussian_features():
    clients, C = federation(seed=4)
    res = engine.run(F.Fed3R(), from_arrays(clients, C), rounds=1, progress=False)
    W, bias = authors_fed3r(clients, C, F.Fed3RConfig().lam)
    np.testing.assert_allclose(res.server_state.weight.T.numpy(), W.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(res.server_state.bias.numpy(), bias.numpy(), rtol=0, atol=1e-5)


def test_no_bias_variant_equals_fedcofs_fed3r():
    clients, C = federation(seed=1, dyadic=True)
    data = from_arrays(clients, C)
    res = engine.run(F.Fed3R(F.Fed3RConfig(bias=False, lam=0.01)), data, rounds=1, progress=False)
    stats = {}
    for k, (x, y, _, _) in enumerate(clients):
        cl = Fed3RClient(k, torch.from_numpy(x), torch.from_numpy(y))
        cl.compute()
        stats[k] = cl.send()
    srv = Fed3RServer(stats, C, x.shape[1], 0.01)
    srv.aggregate()
    ref = srv.get_classifier_weights()  # [C, D], float32 pinv
    np.testing.assert_allclose(res.server_state.weight.numpy(), ref.numpy(), rtol=0, atol=2e-5)
    assert torch.equal(res.server_state.bias, torch.zeros(C, dtype=torch.float64))
    assert res.server_state.gram.shape == (x.shape[1], x.shape[1])


@pytest.mark.parametrize("eng", engine.ENGINES)
@pytest.mark.parametrize("name", ["fed3r", "fedncm"])
def test_any_order_and_grouping_of_clients_gives_the_same_head(name, eng):
    """Fed3R's and FedNCM's heads are sums + finalize: permuting the clients, or adding their
    messages to the server in other groups, moves them by float64 rounding only."""
    clients, C = federation(seed=2, M=6)
    make = (lambda: F.Fed3R()) if name == "fed3r" else FedNCM
    key = (lambda s: (s.weight, s.bias)) if name == "fed3r" else (lambda s: (s.means,))
    base = engine.run(make(), from_arrays(clients, C), rounds=1, engine=eng, progress=False)
    perm = [4, 0, 5, 2, 1, 3]
    other = engine.run(make(), from_arrays([clients[i] for i in perm], C), rounds=1, engine=eng,
                       progress=False)
    for a, b in zip(key(base.server_state), key(other.server_state)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # the server fed the same messages in groups {3}, {5, 0}, {1, 4, 2}
    alg = make()
    data = from_arrays(clients, C)
    init = alg.init(data.spec(), 0)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(6), 6))
    ss = init.server_state
    for g in ([3], [0, 5], [1, 2, 4]):
        ss, _ = alg.server_aggregate(ss, tree_index(msg, torch.tensor(g)), ctx(g, 6))
    for a, b in zip(key(base.server_state), key(ss)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_partial_participation_reaches_the_full_head_and_reports_accuracy_as_clients_accumulate():
    clients, C = federation(seed=3, M=6)
    data = from_arrays(clients, C)
    full = engine.run(F.Fed3R(), data, rounds=1, progress=False)
    part = engine.run(F.Fed3R(), data, rounds=12, fraction=0.5, progress=False)
    seen, first_full = set(), None
    for r in part.history:
        seen |= set(r.participants)
        if first_full is None and len(seen) == 6:
            first_full = r.round
        assert r.accuracy is not None  # every round: the accuracy after the clients seen so far
    assert first_full is not None
    torch.testing.assert_close(part.server_state.weight, full.server_state.weight, rtol=0, atol=1e-12)
    assert torch.equal(part.history[first_full].accuracy["main"], full.final_accuracy())
    # a client that has contributed sends zeros afterwards (FedNCM's "sent" flags)
    twice = engine.run(F.Fed3R(), data, rounds=3, progress=False)
    assert torch.equal(twice.server_state.gram, full.server_state.gram)
    assert all(r.comm.up_values == full.history[0].comm.up_values for r in twice.history)


def test_secure_form_sums_give_the_plain_head():
    """What SecAgg+ adds (secure_form.sums of each client) gives the plain run's head."""
    clients, C = federation(seed=5)
    data = from_arrays(clients, C)
    alg = F.Fed3R()
    init = alg.init(data.spec(), 0)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx(range(5), 5))
    form = alg.secure_form(msg)
    parts = [form.sums(tree_index(msg, torch.tensor([k]))) for k in range(5)]
    assert form.clear(tree_index(msg, torch.tensor([0]))) is None and form.integer == ("counts",)
    totals = {f: sum(p[f] for p in parts) for f in parts[0]}
    sec, _ = form.aggregate(init.server_state, None, totals, ctx(range(5), 5))
    plain, _ = alg.server_aggregate(init.server_state, msg, ctx(range(5), 5))
    torch.testing.assert_close(sec.weight, plain.weight, rtol=0, atol=1e-12)
    assert torch.equal(sec.counts, plain.counts)
    # DP: one example moves each secure field by at most its stated sensitivity
    sens = alg.dp_sensitivity(2.0)
    assert set(sens) == set(parts[0])
    x = torch.tensor([1.2, -1.6, 0.0, 0.0, 0.0])  # ||x|| = 2
    phi = torch.cat([x, torch.ones(1)])
    assert sens["gram"] == pytest.approx(float(torch.linalg.norm(torch.outer(phi, phi))))


def test_secagg_in_the_flower_simulation_gives_the_plain_head(tmp_path):
    pytest.importorskip("flwr")
    from flower_helpers import write_store

    from fedheads.flower.server import FlowerRunConfig
    from fedheads.flower.sim import simulate_store

    store = write_store(tmp_path)
    cfg = dict(algorithm="fed3r", backbones="synth", rounds=1, timeout=120)
    sec = simulate_store(FlowerRunConfig(secagg=True, **cfg), store)
    plain = simulate_store(FlowerRunConfig(**cfg), store)
    assert sec["result"].engine == "flower-secagg"
    a, b = sec["server_state"], plain["server_state"]
    assert torch.equal(a.counts, b.counts)
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=1e-6)  # SecAgg+'s quantisation
    assert (a.weight.argmax(1) == b.weight.argmax(1)).all()


def test_pseudo_inverse_fallback_is_said_and_flagged(caplog):
    """lam = 0 and fewer samples than dimensions: the ridge system is singular."""
    rng = np.random.default_rng(0)
    clients = [(rng.normal(size=(3, 8)).astype(np.float32), np.array([0, 1, 0]),
                rng.normal(size=(2, 8)).astype(np.float32), np.array([0, 1]))]
    data = from_arrays(clients, 2)
    with caplog.at_level(logging.WARNING, logger="fedheads.algorithms.fed3r"):
        res = engine.run(F.Fed3R(F.Fed3RConfig(lam=0.0)), data, rounds=1, progress=False)
    assert bool(res.server_state.pinv) and "pseudo-inverse" in caplog.text
    a = res.server_state.gram
    sol = torch.linalg.pinv(a) @ torch.cat([res.server_state.sums.T, res.server_state.counts.double()[None]])
    w = sol[:8].T / sol[:8].T.norm(dim=1, keepdim=True)
    torch.testing.assert_close(res.server_state.weight, w, rtol=0, atol=1e-9)
    ok = engine.run(F.Fed3R(), data, rounds=1, progress=False)
    assert not bool(ok.server_state.pinv)


def test_linear_head_prototype_view_and_registry():
    clients, C = federation(seed=6)
    data = from_arrays(clients, C)
    alg = create_algorithm("fed3r", lam=0.1)
    assert isinstance(alg, F.Fed3R) and alg.cfg.lam == 0.1
    res = engine.run(alg, data, rounds=1, progress=False)
    ss = res.server_state
    head = alg.linear_head(ss)
    assert head["cls.weight"].shape == (5, C) and head["cls.weight"].dtype == torch.float32
    logits = data.x_test @ head["cls.weight"] + head["cls.bias"]
    scores = alg.predict(res.client_state, ss, data.x_test, data.m_test)["main"]
    torch.testing.assert_close(logits[..., ss.present], scores[..., ss.present].float(), rtol=1e-5, atol=1e-5)
    q, protos, pres, how = alg.prototype_view(res.client_state, ss, data.x_test[:1])
    pred = inference.predict_features(protos[0].numpy(), pres[0].numpy(), how, q[0].numpy())
    np.testing.assert_array_equal(scores[0].argmax(-1).numpy(), pred.labels)
    assert res.trainable_params_per_client == 0
    assert res.upload_values_per_client == 6 * 6 + C * 5 + C  # A_k, class sums, counts
    for f in ("lam", "bias", "dtype"):
        import dataclasses

        assert setting_doc(next(x for x in dataclasses.fields(F.Fed3RConfig) if x.name == f))[0]
    with pytest.raises(UserError, match="lam=-1"):
        create_algorithm("fed3r", lam=-1)
    with pytest.raises(UserError, match="dtype='float16'"):
        create_algorithm("fed3r", dtype="float16")
    r64 = engine.run(create_algorithm("fed3r"), data, rounds=1, progress=False)
    r32 = engine.run(create_algorithm("fed3r", dtype="float32"), data, rounds=1, progress=False)
    torch.testing.assert_close(r32.server_state.weight, r64.server_state.weight, rtol=0, atol=1e-5)
    assert r32.total_comm().up_bytes < r64.total_comm().up_bytes


def test_fedncm_linear_head_is_the_fedncm_ft_head():
    clients, C = federation(seed=7)
    data = from_arrays(clients, C)
    from fedheads.algorithms.fedncm import linear_head_init

    for bias in ("paper", "authors-code"):
        alg = create_algorithm("fedncm", bias=bias)
        ss = engine.run(alg, data, rounds=1, seed=3, progress=False).server_state
        want = linear_head_init(ss.means, ss.present, bias, seed=3)
        got = alg.linear_head(ss)
        assert all(torch.equal(got[k], want[k]) for k in want)
    # heads that are not linear say so with None
    assert create_algorithm("fedproto").linear_head(None) is None


def test_loop_messages_concatenate_to_the_vectorised_message():
    clients, C = federation(seed=8)
    data = from_arrays(clients, C)
    alg = F.Fed3R()
    init = alg.init(data.spec(), 0)
    _, whole = alg.client_update(init.client_state, init.broadcast, data, ctx(range(5), 5))
    rows = [alg.client_update(tree_index(init.client_state, torch.tensor([k])), init.broadcast,
                              data.select([k]), ctx([k], 5))[1] for k in range(5)]
    cat = tree_cat(rows)
    torch.testing.assert_close(cat.gram, whole.gram, rtol=0, atol=1e-9)
    assert torch.equal(cat.counts, whole.counts)


@pytest.mark.parametrize("name", ["fed3r", "fedcof"])
def test_train_runs_one_pass_and_results_give_accuracy_as_clients_accumulate(tmp_path, name):
    """`train` at fraction 1 runs the one round a one-pass head needs (AlgorithmBase.one_pass);
    with clients sampled, results.json's history gives accuracy against the clients seen so far."""
    from flower_helpers import write_store

    import fedheads

    store = write_store(tmp_path)
    one = fedheads.train(store, name, backbones="synth", rounds=4, seeds=0)
    assert one.training_rounds == 1 and [h["round"] for h in one.history] == [1]
    assert one.history[0]["clients_seen"] == 3
    part = fedheads.train(store, name, backbones="synth", rounds=6, seeds=[0, 1], fraction=0.4)
    seen = [h["clients_seen"] for h in part.history]
    assert part.training_rounds == 6 and len(seen) == 6 and seen == sorted(seen) and seen[0] == 1
    assert seen[-1] == 3 and part.history[-1]["accuracy"] == pytest.approx(one.accuracy["mean"], abs=1e-9)


@pytest.mark.parametrize("name", ["fed3r", "fedcof"])
def test_trains_saves_and_predicts_through_the_cli(tmp_path, name):
    """`fedheads train` then `fedheads predict` (faiss, inner product through prototype_view)
    give the trainer's per-client accuracies."""
    from tests.test_fedheads_cli import train_then_predict

    train_then_predict(tmp_path, "--algorithm", name, "--rounds", "1", "--seeds", "2")


@pytest.mark.parametrize("name", ["fed3r", "fedcof"])
@pytest.mark.parametrize("eng", engine.ENGINES)
def test_lp_from_the_head_starts_at_the_head(name, eng):
    """Fed3R+LP / FedCOF+LP (lp init=NAME): round 0 runs the head on the features and the linear
    layer starts as its classifier, so the accuracy after round 0 is the head's."""
    clients, C = federation(seed=9)
    data = from_arrays(clients, C)
    head = engine.run(create_algorithm(name), data, rounds=1, engine=eng, progress=False)
    lp = create_algorithm("lp", init=name, lr=0.05, batch_size=4)
    assert lp.collect_rounds == 1
    res = engine.run(lp, data, rounds=3, engine=eng, progress=False)
    assert torch.equal(res.history[0].accuracy["main"], head.final_accuracy())
    want = create_algorithm(name).linear_head(head.server_state)
    assert res.history[0].comm.up_values == head.history[0].comm.up_values  # round 0 sends the head's statistics
    first = engine.run(create_algorithm("lp", init=name), data, rounds=1, engine=eng, progress=False)
    for k in want:
        torch.testing.assert_close(first.server_state.params[k], want[k], rtol=0, atol=1e-6)
    assert res.history[-1].accuracy is not None and res.trainable_params_per_client > 0
    mlp = engine.run(create_algorithm("mlp", init=name, hidden=[8, 8], batch_size=4), data, rounds=2, engine=eng,
                     progress=False)
    assert mlp.server_state.params["cls.weight"].shape == (8, C)
    with pytest.raises(UserError, match="init 'fedproto': must be one of random, (.*, )?fed3r, (.*, )?fedcof, fedncm"):
        create_algorithm("lp", init="fedproto")
