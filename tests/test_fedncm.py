"""FedNCM (Legate et al. 2023, Alg. 1): exact federated class means, engines, head init."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms import fedncm as F
from fedheads.core import engine
from fedheads.prediction import prototypes as inference
from fedheads.run.load import from_arrays


def close(a, b, atol=1e-12):
    """numpy comparison (torch.testing's first call costs seconds of lazy imports)."""
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=0, atol=atol)


def _federation(seed=0, M=4, C=6, D=5):
    """Non-IID clients of different sizes; class 5 held by nobody, class 4 by one client."""
    rng = np.random.default_rng(seed)
    clients = []
    for k in range(M):
        n = int(rng.integers(5, 30))
        classes = [0, 1, 2, 3] + ([4] if k == 2 else [])
        y = rng.choice(classes, size=n)
        x = rng.normal(size=(n, D)) + 3 * np.eye(C, D)[y] + k   # a per-client feature shift
        yt = rng.choice([0, 1, 2, 3], size=7)
        xt = rng.normal(size=(7, D)) + 3 * np.eye(C, D)[yt] + k
        clients.append((x.astype(np.float32), y, xt.astype(np.float32), yt))
    return clients, C


def test_client_stats_hand_computed():
    x = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [9.0, 9.0]]])
    y = torch.tensor([[0, 1, 0, 1]])
    m = torch.tensor([[True, True, True, False]])   # last row is padding
    sums, counts = F.client_stats(x, y, m, num_classes=3)
    assert sums.tolist() == [[[6.0, 8.0], [3.0, 4.0], [0.0, 0.0]]]
    assert counts.tolist() == [[2, 1, 0]]
    means, present = F.finalize_means(sums[0], counts[0])
    assert means.tolist() == [[3.0, 4.0], [3.0, 4.0], [0.0, 0.0]]
    assert present.tolist() == [True, True, False]


def test_client_stats_blocks_and_padding_agree():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 11, 4, generator=g)
    y = torch.randint(0, 5, (3, 11), generator=g)
    m = torch.arange(11).view(1, 11) < torch.tensor([11, 7, 2]).view(3, 1)
    a = F.client_stats(x, y, m, 5, block_rows=3)
    b = F.client_stats(x, y, m, 5, block_rows=1000)
    close(a[0], b[0])
    assert torch.equal(a[1], b[1]) and a[1].sum(1).tolist() == [11, 7, 2]
    ref = torch.zeros(5, 4, dtype=torch.float64)
    for i in range(7):
        ref[y[1, i]] += x[1, i].double()
    close(a[0][1], ref)


@pytest.mark.parametrize("eng", engine.ENGINES)
def test_equals_centralised_ncm_on_pooled_data(eng):
    clients, C = _federation()
    data = from_arrays(clients, C)
    res = engine.run(F.FedNCM(), data, rounds=1, engine=eng, progress=False)
    ss = res.server_state
    X = np.concatenate([c[0] for c in clients]).astype(np.float64)
    Y = np.concatenate([c[1] for c in clients])
    for c in range(C):
        if c == 5:
            assert not bool(ss.present[c]) and int(ss.counts[c]) == 0
            continue
        np.testing.assert_allclose(ss.means[c].numpy(), X[Y == c].mean(0), rtol=0, atol=1e-6)
        assert int(ss.counts[c]) == int((Y == c).sum())
    assert res.trainable_params_per_client == 0


def test_engine_equals_loop_and_partial_participation():
    clients, C = _federation(seed=1, M=6)
    data = from_arrays(clients, C)
    a = engine.run(F.FedNCM(), data, rounds=1, engine="vectorized", progress=False)
    b = engine.run(F.FedNCM(), data, rounds=1, engine="loop", progress=False)
    close(a.server_state.means, b.server_state.means)
    for rule in ("main", "cosine", "sqeuclidean"):
        close(a.final_accuracy(rule), b.final_accuracy(rule), atol=0)
    # half the clients per round: once every client has been drawn, the means are exact
    p = engine.run(F.FedNCM(), data, rounds=12, fraction=0.5, progress=False, eval_every=0)
    seen = set().union(*(r.participants for r in p.history))
    assert seen == set(range(6))
    close(p.server_state.means, a.server_state.means)


def test_message_traffic_is_sums_and_counts():
    clients, C = _federation()
    data = from_arrays(clients, C)
    res = engine.run(F.FedNCM(), data, rounds=1, progress=False)
    D, M = 5, 4
    assert res.upload_values_per_client == C * D + C
    tot = res.total_comm()
    assert tot.up_bytes == M * (8 * C * D + 8 * C)
    assert tot.down_values == 0
    r32 = engine.run(F.FedNCM(F.FedNCMConfig(dtype="float32")), data, rounds=1, progress=False)
    assert r32.total_comm().up_bytes == M * (4 * C * D + 8 * C)
    close(r32.server_state.means, res.server_state.means, atol=1e-5)


@pytest.mark.parametrize("rule", F.RULES)
def test_predict_matches_faiss_inference(rule):
    clients, C = _federation(seed=2)
    data = from_arrays(clients, C)
    alg = F.FedNCM(F.FedNCMConfig(rule=rule))
    res = engine.run(alg, data, rounds=1, progress=False)
    ss = res.server_state
    scores = alg.predict(res.client_state, ss, data.x_test, data.m_test)["main"]
    assert torch.isinf(scores[..., 5]).all()          # absent class never predicted
    for k, (_, _, xt, _) in enumerate(clients):
        pred = inference.predict_features(ss.means.numpy(), ss.present.numpy(), rule, xt)
        np.testing.assert_array_equal(scores[k, : len(xt)].argmax(-1).numpy(), pred.labels)


def test_linear_head_init_zero_and_random_bias():
    means = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, -2.0]], dtype=torch.float64)
    present = torch.tensor([True, False, True])
    h = F.linear_head_init(means, present, bias="zero")
    assert h["cls.weight"].shape == (2, 3)
    close(h["cls.weight"].T, [[0.6, 0.8], [0, 0], [0, -1.0]], atol=1e-7)
    assert h["cls.bias"].tolist() == [0.0, 0.0, 0.0]
    # zero bias: logits = ||x|| cos(x, l_c) -> argmax equals the cosine NCM
    x = torch.randn(50, 2, dtype=torch.float64)
    logits = x.float() @ h["cls.weight"] + h["cls.bias"]
    logits[:, 1] = -torch.inf
    ref = F.ncm_scores(means, present, x, "cosine")
    assert torch.equal(logits.argmax(1), ref.argmax(1))
    r1 = F.linear_head_init(means, present, bias="random", seed=1)
    r1b = F.linear_head_init(means, present, bias="random", seed=1)
    r2 = F.linear_head_init(means, present, bias="random", seed=2)
    assert torch.equal(r1["cls.bias"], r1b["cls.bias"]) and not torch.equal(r1["cls.bias"], r2["cls.bias"])
    assert (r1["cls.bias"].abs() <= 1 / np.sqrt(2)).all() and (r1["cls.bias"] != 0).all()
    close(r1["cls.weight"], h["cls.weight"], atol=0)
    with pytest.raises(UserError, match="bias='learned'"):
        F.linear_head_init(means, present, bias="learned")


def test_config_errors_and_registry():
    with pytest.raises(UserError, match="rule='manhattan'"):
        F.FedNCM(F.FedNCMConfig(rule="manhattan"))
    with pytest.raises(UserError, match="dtype='float16'"):
        F.FedNCM(F.FedNCMConfig(dtype="float16"))
    alg = create_algorithm("fedncm", rule="sqeuclidean")
    assert alg.name == "fedncm" and alg.cfg.rule == "sqeuclidean"


def test_rounds_after_the_first_change_nothing_with_every_client():
    """Why `train`/`compare` run FedNCM for one round at fraction 1: later rounds add zeros."""
    clients, C = _federation(seed=2, M=4)
    data = from_arrays(clients, C)
    one = engine.run(F.FedNCM(), data, rounds=1, progress=False)
    four = engine.run(F.FedNCM(), data, rounds=4, progress=False)
    assert torch.equal(one.server_state.means, four.server_state.means)
    assert torch.equal(one.final_accuracy("main"), four.final_accuracy("main"))


def test_authors_code_bias_is_torch_linear_init_for_the_same_seed():
    for C, D, seed in ((6, 5, 0), (10, 512, 3), (3, 1, 11)):
        torch.manual_seed(seed)
        want = torch.nn.Linear(D, C).bias.detach()
        state = torch.random.get_rng_state()
        got = F.authors_code_bias(C, D, seed)
        assert torch.equal(got, want)  # bit for bit, weight drawn first as nn.Linear does
        assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    means = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, -2.0]], dtype=torch.float64)
    present = torch.tensor([True, False, True])
    h = F.linear_head_init(means, present, bias="authors-code", seed=4)
    assert torch.equal(h["cls.bias"], F.authors_code_bias(3, 2, 4))
    assert torch.equal(F.linear_head_init(means, present, bias="random", seed=4)["cls.bias"], h["cls.bias"])


def test_authors_code_head_is_their_linear_layer_and_the_paper_head_is_unchanged():
    clients, C = _federation(seed=3)
    data = from_arrays(clients, C)
    paper = engine.run(F.FedNCM(), data, rounds=1, seed=5, progress=False)
    ss = paper.server_state
    # the paper's head: no bias leaf (state files keep their layout), main = the cosine NCM exactly
    assert ss.bias is None and F.FedNCMConfig().bias == "paper"
    out = F.FedNCM().predict(paper.client_state, ss, data.x_test, data.m_test)
    assert set(out) == {"main", *F.RULES}
    assert torch.equal(out["main"], F.ncm_scores(ss.means, ss.present, data.x_test, "cosine"))

    alg = create_algorithm("fedncm", bias="authors-code")
    res = engine.run(alg, data, rounds=1, seed=5, progress=False)
    assert torch.equal(res.server_state.means, ss.means)  # the means do not depend on the head
    assert torch.equal(res.server_state.bias, F.authors_code_bias(C, data.dim, 5))
    # the authors' head: nn.Linear(D, C) with weight <- l_c/||l_c||, its random bias kept, on raw features
    torch.manual_seed(5)
    lin = torch.nn.Linear(data.dim, C).double()
    with torch.no_grad():
        lin.weight.copy_(torch.nn.functional.normalize(ss.means, dim=-1))
    scores = alg.predict(res.client_state, res.server_state, data.x_test, data.m_test)
    with torch.no_grad():
        ref = lin(data.x_test.double()).masked_fill(~ss.present, float("-inf"))
    close(scores["main"][..., ss.present], ref[..., ss.present], atol=1e-12)
    assert torch.isinf(scores["main"][..., ~ss.present]).all()
    # faiss batch prediction (fedheads predict) gives the same labels through prototype_view
    q, protos, pres, how = alg.prototype_view(res.client_state, res.server_state, data.x_test[:1])
    pred = inference.predict_features(protos[0].numpy(), pres[0].numpy(), how, q[0].numpy())
    np.testing.assert_array_equal(scores["main"][0].argmax(-1).numpy(), pred.labels)
    with pytest.raises(UserError, match="bias=authors-code"):
        F.FedNCM(F.FedNCMConfig(bias="authors-code", rule="sqeuclidean"))
    with pytest.raises(UserError, match="bias='learned'"):
        F.FedNCM(F.FedNCMConfig(bias="learned"))


def test_authors_code_head_trains_saves_and_predicts_through_the_cli(tmp_path):
    """`fedheads train --set bias=authors-code`: the state keeps the bias (one more leaf) and
    `fedheads predict` (faiss, inner product on [x, 1]) gives the trainer's accuracies."""
    from tests.test_fedheads_cli import train_then_predict

    train_then_predict(tmp_path, "--algorithm", "fedncm", "--set", "bias=authors-code", "--rounds", "1", "--seeds", "2")
