"""FedPFT (fedheads/algorithms/fedpft.py): the mixtures a client sends are scikit-learn's
GaussianMixture fitted to its class features, the server's synthetic features have the mixtures'
moments, runs are a function of the seed and of no client order, both engines agree, partial
participation reaches the one-round head, and the head learns a label-skewed federation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fed_tiny import tiny_fed
from sklearn.mixture import GaussianMixture
from test_ccvr import skewed_fed
from test_engine_equivalence import BUCKETS, _assert_engines_agree, bucketed_fed

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms.fedpft import FedPFT, FedPFTConfig, gmm_seed, sample_mixture
from fedheads.core import run
from fedheads.core.federation import to_layout
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import tree_leaves

FAST = dict(server_lr=1e-2, server_epochs=10)  # the baseline's lr 1e-4 barely moves a head on a tiny federation


@pytest.mark.parametrize("covariance", ["spherical", "diag", "full", "tied"])
def test_message_is_sklearn_gaussian_mixture_of_each_class(covariance):
    data = tiny_fed(M=4, D=4, C=3, seed=1)
    cfg = FedPFTConfig(components=2, covariance=covariance, small_classes="skip")  # the baseline's learn_gmm
    alg = FedPFT(cfg)
    init = alg.init(data.spec(), seed=7)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, RoundCtx(0, 7, torch.arange(4), 4))
    fitted = 0
    for i in range(4):
        x = data.x_train[i][data.m_train[i]].double().numpy()
        y = data.y_train[i][data.m_train[i]].numpy()
        for c in range(3):
            n = int((y == c).sum())
            if n <= 2:  # the baseline sends no mixture of K or fewer features
                assert int(msg.counts[i, c]) == 0 and not msg.means[i, c].any()
                continue
            g = GaussianMixture(n_components=2, covariance_type=covariance, tol=1e-12, max_iter=1000,
                                random_state=gmm_seed(7, int(data.client_index[i]), c)).fit(x[y == c])
            assert int(msg.counts[i, c]) == n
            np.testing.assert_allclose(msg.weights[i, c].double().numpy(), g.weights_, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(msg.means[i, c].double().numpy(), g.means_, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(msg.covariances[i, c].double().numpy(), g.covariances_, rtol=1e-6, atol=1e-6)
            fitted += 1
    assert fitted >= 6


@pytest.mark.parametrize("covariance", ["spherical", "diag", "full", "tied"])
def test_synthetic_features_have_the_mixture_moments(covariance):
    """Mean and covariance of many draws equal the mixture's: sum_j pi_j m_j and
    sum_j pi_j (S_j + m_j m_j^T) - mean mean^T."""
    D, K = 3, 2
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    m = torch.tensor([[2.0, 0.0, -1.0], [-1.0, 1.0, 0.5]], dtype=torch.float64)
    a = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.0, 0.3, 0.5]], dtype=torch.float64)
    full = torch.stack([a @ a.T, torch.diag(torch.tensor([0.5, 0.2, 1.5], dtype=torch.float64))])
    s = {"spherical": torch.tensor([0.4, 1.3], dtype=torch.float64), "diag": full.diagonal(dim1=1, dim2=2).clone(),
         "full": full, "tied": full[0]}[covariance]
    comp_cov = {"spherical": lambda: s.view(K, 1, 1) * torch.eye(D, dtype=torch.float64),
                "diag": lambda: torch.diag_embed(s), "full": lambda: s, "tied": lambda: s.expand(K, D, D)}[covariance]()
    z = sample_mixture(w, m, s, covariance, 200000, 1, 2, 3)
    mean = (w.view(K, 1) * m).sum(0)
    cov = (w.view(K, 1, 1) * (comp_cov + m.unsqueeze(2) * m.unsqueeze(1))).sum(0) - torch.outer(mean, mean)
    torch.testing.assert_close(z.mean(0), mean, atol=0.02, rtol=0)
    torch.testing.assert_close(z.T.cov(), cov, atol=0.03, rtol=0)
    assert torch.equal(z[:50], sample_mixture(w, m, s, covariance, 50, 1, 2, 3))  # keyed rows: a prefix is a prefix


def test_head_learns_label_skew_and_is_a_function_of_the_seed():
    data = skewed_fed()
    a = run(create_algorithm("fedpft", **FAST), data, rounds=1, seed=0, progress=False)
    b = run(create_algorithm("fedpft", **FAST), data, rounds=1, seed=0, progress=False)
    c = run(create_algorithm("fedpft", **FAST), data, rounds=1, seed=1, progress=False)
    assert float(a.final_accuracy().mean()) > 0.6  # chance is 0.25
    for ta, tb in zip(tree_leaves(a.server_state), tree_leaves(b.server_state)):
        assert torch.equal(ta, tb)
    assert not torch.equal(a.server_state.head["cls.weight"], c.server_state.head["cls.weight"])


def test_head_does_not_depend_on_the_clients_order():
    data = tiny_fed(M=6)
    ordered, order = data.by_size()
    a = run(create_algorithm("fedpft", **FAST), data, rounds=1, seed=3, progress=False)
    b = run(create_algorithm("fedpft", **FAST), ordered, rounds=1, seed=3, progress=False)
    assert list(order) != list(range(6))
    for k in a.server_state.head:
        torch.testing.assert_close(a.server_state.head[k], b.server_state.head[k], rtol=1e-5, atol=1e-6)


def test_partial_participation_reaches_the_one_round_head():
    data = tiny_fed()
    one = run(create_algorithm("fedpft", **FAST), data, rounds=1, seed=2, progress=False)
    part = run(create_algorithm("fedpft", **FAST), data, rounds=8, seed=2, fraction=0.5, progress=False)
    assert sorted({i for h in part.history for i in h.participants}) == [0, 1, 2, 3]
    assert part.history[-1].comm.up_values == 0  # a client that has sent its mixtures sends nothing more
    for k in one.server_state.head:
        torch.testing.assert_close(one.server_state.head[k], part.server_state.head[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_engines_agree(fraction):
    make = lambda: FedPFT(FedPFTConfig(covariance="diag", components=2, **FAST))  # noqa: E731
    _assert_engines_agree(make, tiny_fed(), tiny_fed(), fraction, trains=False)
    _assert_engines_agree(make, bucketed_fed(), tiny_fed(M=6), fraction, trains=False)
    ordered = tiny_fed(M=6).by_size()[0]  # stored largest first, as `fedheads train` loads them
    _assert_engines_agree(make, to_layout(ordered, BUCKETS), ordered, fraction, trains=False)


def test_float16_as_the_baseline_sends_and_refusals():
    data = tiny_fed()
    r16 = run(create_algorithm("fedpft", dtype="float16", **FAST), data, rounds=1, seed=0, progress=False)
    r32 = run(create_algorithm("fedpft", **FAST), data, rounds=1, seed=0, progress=False)
    assert r16.upload_values_per_client == r32.upload_values_per_client
    assert float(r16.final_accuracy().mean()) > 0.5
    alg = create_algorithm("fedpft")
    assert alg.global_rule == "main"
    with pytest.raises(UserError, match="fedpft.*not sums"):
        alg.secure_form()
    for bad in ({"covariance": "banded"}, {"components": 0}, {"dtype": "int8"}, {"server_lr": 0.0}):
        with pytest.raises(UserError):
            create_algorithm("fedpft", **bad)


def test_cli_train_then_predict_equals_the_evaluation(tmp_path):
    from test_fedheads_cli import train_then_predict

    acc = train_then_predict(tmp_path, "--algorithm", "fedpft", "--rounds", "1", "--seeds", "1", "--set", "server_lr=0.01",
                             "--set", "server_epochs=5")
    assert min(acc.values()) > 40.0  # chance is 25


@pytest.mark.parametrize("covariance,components", [("spherical", 1), ("diag", 2), ("full", 1), ("tied", 2)])
def test_bytes_sent_are_the_mixtures_sent(covariance, components):
    """Per class a client sends (label, count and its fitted components: weight, mean, covariance;
    "tied" one covariance per class) and its id once; the dense message's empty slots are not sent."""
    data = tiny_fed(M=4, D=4, C=3, seed=1)
    res = run(FedPFT(FedPFTConfig(covariance=covariance, components=components, server_epochs=1)), data, 1, seed=0,
              progress=False)
    ss, D = res.server_state, 4
    fitted = int(((ss.weights > 0) & (ss.counts > 0).unsqueeze(-1)).sum())
    classes, senders = int((ss.counts > 0).sum()), int((ss.counts > 0).any(1).sum())
    per_comp = 1 + D + {"spherical": 1, "diag": D, "full": D * D, "tied": 0}[covariance]
    floats = fitted * per_comp + (classes * D * D if covariance == "tied" else 0)
    want = 4 * floats + 8 * (2 * classes + senders)  # float32 parameters, int64 labels, counts and ids
    assert 0 < classes < 4 * 3 or fitted < 4 * 3 * components  # some slot is empty: the dense count would differ
    assert abs(res.history[0].comm.up_bytes - want) <= 4  # per-client average rounded, times 4 clients
