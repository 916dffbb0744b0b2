"""FedCGS (Guan et al., AAAI 2025; fedheads/algorithms/fedcgs.py): equal to the authors' code on the
same features, the global covariance equal to the pooled data's whatever the partition, the stable
solve of a singular covariance against the literal one, the personal prior, the engines and the
summed path, partial participation, SecAgg+ and DP, and the bytes sent."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fed_tiny import check_secure_form, few_rows, pooled
from test_ghofl import gaussians_federation

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms.fedcgs import global_gaussian
from fedheads.core import run
from fedheads.core.protocol import HeadArch
from fedheads.core.tree import tree_leaves
from fedheads.run.load import from_arrays


# ---------------------------------------------------------------- the authors' code (oracle)
# Yuqin-G/FedCGS main_fedcgs.py (the statistics and the covariance, gamma = 0) and utils_fl.py
# eval_lda (the head, as the fc layer it writes), transcribed; the backbone is the identity, the
# DataLoaders lists of batches, the device the CPU.
def authors_fedcgs(clients, num_classes, gamma=0.0, batch=16):
    num_d = clients[0][0].shape[1]
    cs_l, cc_l, Ax_l, Bx_l = [], [], [], []
    for x, y, _, _ in clients:
        loader = [(torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch])) for i in range(0, len(y), batch)]
        cs1 = torch.zeros((num_classes, num_d)).double()
        cc1 = torch.zeros(num_classes)
        Ax1 = torch.zeros(num_d).double()
        Bx1 = torch.zeros((num_d, num_d)).double()
        for X, y in loader:  # noqa: B007
            with torch.no_grad():
                feature_t = X.double()
                cs1.scatter_add_(0, y.unsqueeze(1).expand_as(feature_t).to(torch.int64), feature_t)
                cc1.scatter_add_(0, y.to(torch.int64), torch.ones(len(y)))
                Ax1 += feature_t.double().sum(axis=0)
                Bx1 += feature_t.T @ feature_t
        cs_l.append(cs1)
        cc_l.append(cc1)
        Ax_l.append(Ax1)
        Bx_l.append(Bx1)
    cc = sum(cc_l).double()
    cs = sum(cs_l).double()
    Ax = sum(Ax_l).double()
    Bx = sum(Bx_l).double()
    N = cc.sum()
    mu = Ax / N
    mu_A = torch.ger(mu.T, Ax.double())
    A_mu = torch.ger(Ax.double().T, mu)
    mu_mu = torch.ger(mu.T, mu.double()) * N
    Sx = (Bx - mu_A - A_mu + mu_mu) / (N - 1)
    class_means = torch.div(cs, torch.reshape(cc, (-1, 1))).double()
    Aj, S, Nj = class_means, Sx, cc
    S_hat = S + gamma * torch.eye(num_d)
    S_inv = torch.tensor(np.linalg.inv(S_hat.detach()))
    # eval_lda
    W = Aj @ torch.tensor(S_inv)
    b = torch.zeros(Aj.size(0))
    for i in range(Aj.size(0)):
        b[i] = -(Aj[i].T @ S_inv @ Aj[i]) / 2 + torch.log(Nj[i] / N)
    return W, b, Sx


# ---------------------------------------------------------------- helpers
def _run(clients, C, engine="vectorized", rounds=1, fraction=1.0, budget=None, **cfg):
    kw = {} if budget is None else {"message_budget": budget}
    return run(create_algorithm("fedcgs", **cfg), from_arrays(clients, C), rounds, seed=0, engine=engine,
               fraction=fraction, progress=False, **kw)


def _predict(res, x, **cfg):
    M = len(res.client_state.sent)
    xs = x.unsqueeze(0).expand(M, -1, -1)
    return create_algorithm("fedcgs", **cfg).predict(res.client_state, res.server_state, xs,
                                                      torch.ones(xs.shape[:2], dtype=torch.bool))


# ---------------------------------------------------------------- tests
@pytest.mark.filterwarnings("ignore:.*(x.T|copy construct).*:UserWarning")  # the transcription's torch idioms
def test_equals_the_authors_code():
    clients, C = gaussians_federation(seed=1, D=8)
    W, b, _ = authors_fedcgs(clients, C)
    res = _run(clients, C)
    ss = res.server_state
    torch.testing.assert_close(ss.weight.T, W, rtol=1e-9, atol=1e-10)
    bias = ss.quad + torch.log(ss.counts.double() / ss.counts.sum())
    torch.testing.assert_close(bias.float(), b, rtol=1e-6, atol=1e-5)  # the code's bias is a float32 tensor
    x = torch.from_numpy(np.concatenate([c[2] for c in clients]))
    fc = x @ W.float().T + b  # the fc layer eval_lda writes, in float32
    main = _predict(res, x)["main"][0]
    torch.testing.assert_close(main.float(), fc, rtol=1e-4, atol=1e-3)
    assert bool((main.argmax(1) == fc.argmax(1)).all())


def test_the_covariance_is_the_pooled_datas_whatever_the_partition():
    clients, C = gaussians_federation(seed=2, D=7)
    x, y = pooled(clients)
    cov = np.cov(x.T, ddof=1)
    means = np.stack([x[y == c].mean(0) for c in range(C)])
    want = np.linalg.solve(cov, means.T)
    order = np.random.default_rng(0).permutation(len(y))
    for parts in (1, 4, 11):
        again = [(x[i].astype(np.float32), y[i], clients[0][2], clients[0][3]) for i in np.array_split(order, parts)]
        ss = _run(again, C).server_state
        np.testing.assert_allclose(ss.weight.numpy(), want, rtol=1e-5, atol=1e-7)  # float32 features, float64 sums


def test_a_singular_covariance_is_solved_stably_and_said():
    """30 rows of 40-d features: S has rank 29. The stable solve is the minimum-norm one (a note
    says so); the literal one inverts S as the authors' code does."""
    C = 3
    clients = few_rows(40, C, rows=10)
    x, y = pooled(clients)
    stable = _run(clients, C)
    assert bool(stable.server_state.pinv)
    means = np.stack([x[y == c].mean(0) for c in range(C)])
    np.testing.assert_allclose(stable.server_state.weight.numpy(), np.linalg.pinv(np.cov(x.T, ddof=1)) @ means.T,
                               rtol=1e-5, atol=1e-7)
    (note, *_) = create_algorithm("fedcgs").trained_notes(stable.server_state, ["a", "b", "c"])
    assert "singular" in note and "pseudo-inverse" in note and "solve=literal" in note
    literal = _run(clients, C, solve="literal")
    assert not bool(literal.server_state.pinv)
    assert float(literal.server_state.weight.norm()) > 100 * float(stable.server_state.weight.norm())
    assert float(stable.final_accuracy().mean()) > 0.9
    assert float(literal.final_accuracy().mean()) < float(stable.final_accuracy().mean())
    ridge = _run(clients, C, gamma=0.5)
    assert not bool(ridge.server_state.pinv) and float(ridge.final_accuracy().mean()) > 0.9


def test_the_personal_rule_is_the_global_gaussians_with_each_clients_own_prior():
    clients, C = gaussians_federation(seed=3, M=3)
    x1, y1, xt1, yt1 = clients[1]
    clients[1] = (x1[y1 < 2], y1[y1 < 2], xt1, yt1)  # client 1 holds classes 0 and 1 only
    res = _run(clients, C, prior_smoothing=0.0)
    x = torch.from_numpy(np.concatenate([c[2] for c in clients]))
    out = _predict(res, x, prior_smoothing=0.0)
    assert set(out["personal"][1].argmax(1).tolist()) <= {0, 1}  # a class it lacks: never predicted
    for k, (_, yk, _, _) in enumerate(clients):
        n = np.bincount(yk, minlength=C)
        with np.errstate(divide="ignore"):
            prior = torch.from_numpy(np.log(n / n.sum()))
        want = out["main"][k] - torch.log(res.server_state.counts.double() / res.server_state.counts.sum()) + prior
        torch.testing.assert_close(out["personal"][k], want)
    smooth = _predict(_run(clients, C), x)["personal"]
    assert bool(torch.isfinite(smooth).all())


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_engines_the_summed_path_and_partial_participation_agree(fraction):
    clients, C = gaussians_federation(seed=5, M=6)
    rounds = 1 if fraction == 1.0 else 12
    loop = _run(clients, C, engine="loop", rounds=rounds, fraction=fraction)
    full = _run(clients, C)
    for other in (_run(clients, C, rounds=rounds, fraction=fraction), _run(clients, C, rounds=rounds, fraction=fraction,
                                                                             budget=1)):
        assert [h.comm for h in other.history] == [h.comm for h in loop.history]
        for ta, tb in zip(tree_leaves(other.server_state), tree_leaves(loop.server_state)):
            torch.testing.assert_close(ta, tb, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(loop.server_state.weight, full.server_state.weight, rtol=1e-7, atol=1e-8)


def test_bytes_sent_are_the_classes_each_client_holds():
    clients, C = gaussians_federation(seed=8, M=5, C=6, D=7)
    x1, y1, xt1, yt1 = clients[1]
    clients[1] = (x1[y1 < 2], y1[y1 < 2], xt1, yt1)
    D = 7
    held = [len(np.unique(c[1])) for c in clients]
    want = sum(D * D + h * (D + 2) for h in held)
    for budget in (None, 1):
        comm = _run(clients, C, budget=budget).history[0].comm
        assert abs(comm.up_values - want) <= len(clients) and abs(comm.up_bytes - 8 * want) <= 8 * len(clients)
    paper = create_algorithm("fedcgs").paper_round_comm(HeadArch((D,), 0, C), 5)
    assert (paper.upload, paper.download) == (C * D + C + D + D * D, C * D + C + D * D)


def test_the_secure_form_gives_the_plain_head_and_dp_stays_defined():
    from fedheads.privacy import Mechanism, Private

    clients, C = gaussians_federation(seed=9, M=4)
    data = from_arrays(clients, C)
    plain = check_secure_form(create_algorithm("fedcgs"), data)
    tiny = run(Private(create_algorithm("fedcgs"), Mechanism(noise_multiplier=1e-9, clip=100.0, noise_seed=1)), data,
               1, seed=0, progress=False)
    torch.testing.assert_close(tiny.server_state.weight, plain.weight, rtol=1e-4, atol=1e-6)
    noisy = run(Private(create_algorithm("fedcgs"), Mechanism(epsilon=1.0, delta=1e-5, clip=1.0, noise_seed=2)), data,
                1, seed=0, progress=False)
    assert bool(torch.isfinite(noisy.server_state.weight).all()) and not bool(noisy.server_state.pinv)


def test_linear_head_predicts_as_the_rule_and_settings_are_checked():
    clients, C = gaussians_federation(seed=11)
    res = _run(clients, C + 1)  # class 4: no client holds it
    x = torch.from_numpy(np.concatenate([c[2] for c in clients]))
    lin = create_algorithm("fedcgs").linear_head(res.server_state)
    main = _predict(res, x)["main"][0]
    assert bool(((x @ lin["cls.weight"] + lin["cls.bias"]).argmax(1) == main.argmax(1)).all())
    notes = create_algorithm("fedcgs").trained_notes(res.server_state, ["a", "b", "c", "d", "e"])
    assert any("class(es) e" in n for n in notes)
    with pytest.raises(UserError, match="solve 'exact'"):
        create_algorithm("fedcgs", solve="exact")
    with pytest.raises(UserError, match="gamma -1"):
        create_algorithm("fedcgs", gamma=-1)


def test_global_gaussian_is_the_closed_form():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4))
    y = rng.integers(0, 3, 50)
    sums = torch.from_numpy(np.stack([x[y == c].sum(0) for c in range(3)]))
    counts = torch.from_numpy(np.bincount(y, minlength=3))
    w, quad, pinv = global_gaussian(sums, counts, torch.from_numpy(x.T @ x), 0.1, "stable")
    s = np.cov(x.T, ddof=1) + 0.1 * np.eye(4)
    means = sums.numpy() / counts.numpy()[:, None]
    np.testing.assert_allclose(w.numpy(), np.linalg.solve(s, means.T), rtol=1e-10)
    np.testing.assert_allclose(quad.numpy(), -0.5 * np.einsum("cd,dc->c", means, np.linalg.solve(s, means.T)), rtol=1e-10)
    assert not pinv
