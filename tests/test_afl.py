"""AFL (He et al., CVPR 2025; fedheads/algorithms/afl.py): equal to the authors' code on the same
features, independent of how the rows are split among clients and equal to the pooled least squares
(ridge with `lam`), the stable solve of an ill-posed system against the literal one, AFL against
Fed3R without its bias column, the SecAgg+ and DP forms, and the bytes each client sends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fed_tiny import few_rows, pooled
from test_fed3r import federation

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms.afl import AFLConfig
from fedheads.core import run
from fedheads.core.protocol import RoundCtx
from fedheads.run.load import from_arrays


# ---------------------------------------------------------------- the authors' code (oracle)
# ZHUANGHP/Analytic-federated-learning afl.py: local_update, aggregation, clean_regularization,
# transcribed with the device moves (.cuda(...)) dropped and np.mat spelled np.asarray (numpy 2 has no
# np.mat; the inverse is the same)
class _Args:
    def __init__(self, feat_size, num_classes, rg, num_clients):
        self.feat_size, self.num_classes, self.rg, self.num_clients, self.gpu = feat_size, num_classes, rg, num_clients, 0


def local_update(train_loader, model, global_model, args):
    corr_rep = torch.zeros(args.feat_size, args.feat_size)
    corr_label = torch.zeros(args.feat_size, args.num_classes)
    with torch.no_grad():
        for batch_idx, (images, labels) in enumerate(train_loader):  # noqa: B007
            reps = model(images)
            reps, _ = global_model(reps)
            label_onehot = torch.nn.functional.one_hot(labels, args.num_classes).float()
            corr_rep += torch.t(reps) @ reps
            corr_label += torch.t(reps) @ (label_onehot)
        R = torch.inverse(torch.from_numpy(np.asarray((corr_rep.cpu().numpy()) + args.rg * np.eye(corr_rep.size(0)))).double())
        Delta = R @ corr_label.double()
        W = Delta.double()
        R = R.double()
        C = torch.inverse(R).double().cpu()
        R = R.cpu()
    return W, R, C


def aggregation(W, R, C, args):
    if len(W) < 2:
        return W[0], R[0], C[0]
    Wt = (torch.eye(R[0].shape[0]).double() - R[0] @ C[1] + R[0] @ C[1] @ torch.inverse(C[0] + C[1]) @ C[1]) @ W[0] + \
         (torch.eye(R[0].shape[0]).double() - R[1] @ C[0] + R[1] @ C[0] @ torch.inverse(C[0] + C[1]) @ C[0]) @ W[1]
    Ct = C[0] + C[1]
    Rt = torch.inverse(Ct)
    for i in range(1, len(W) - 1):
        Wt = (torch.eye(R[0].shape[0]).double() - Rt @ C[i + 1]
              + Rt @ C[i + 1] @ torch.inverse(Ct + C[i + 1]) @ C[i + 1]) @ Wt + \
             (torch.eye(R[0].shape[0]).double() - R[i + 1] @ Ct + R[i + 1] @ Ct @ torch.inverse(Ct + C[i + 1]) @ Ct) @ W[i + 1]
        Ct = Ct + C[i + 1]
        Rt = torch.inverse(Ct)
    return Wt, Rt, Ct


def clean_regularization(W, C, args):
    R_origin = torch.inverse(C - args.num_clients * args.rg * torch.eye(args.feat_size).float())
    Wt = W + (args.num_clients * args.rg * R_origin) @ W
    return Wt


def authors_afl(clients, C, rg, clean=True, batch=4):
    """main.py: every client's local_update, aggregation, then (--clean_reg) the cleaning."""
    D = clients[0][0].shape[1]
    args = _Args(D, C, rg, len(clients))
    identity = lambda x: (x, None)  # noqa: E731 - LinearAnalytic's activation is nn.Identity
    Ws, Rs, Cs = [], [], []
    for x, y, _, _ in clients:
        loader = [(torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch]).long()) for i in range(0, len(y), batch)]
        W, R, Ck = local_update(loader, lambda im: im, identity, args)
        Ws.append(W)
        Rs.append(R)
        Cs.append(Ck)
    W, _, Ct = aggregation(Ws, Rs, Cs, args)
    return clean_regularization(W, Ct, args) if clean else W


# ---------------------------------------------------------------- helpers
def _run(clients, C, engine="vectorized", rounds=1, fraction=1.0, **cfg):
    data = from_arrays(clients, C)
    return run(create_algorithm("afl", **cfg), data, rounds, seed=0, engine=engine, fraction=fraction, progress=False)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("clean", [True, False])
def test_equals_the_authors_code(clean):
    """Dyadic features (the authors' float32 Grams are exact): W equals local_update + aggregation
    (+ clean_regularization) to float64 rounding."""
    clients, C = federation(seed=3, M=5, C=6, D=5, dyadic=True)
    clients = [c for c in clients if len(c[1]) > 5]  # local Grams well-posed, as on CIFAR with 512-d features
    ref = authors_afl(clients, C, rg=1.0, clean=clean)
    ours = _run(clients, C, clean=clean).server_state.weight
    torch.testing.assert_close(ours, ref, rtol=1e-8, atol=1e-9)


def test_the_result_does_not_depend_on_the_partition_and_is_the_pooled_least_squares():
    clients, C = federation(seed=1, M=6, C=6, D=5)
    x, y = pooled(clients)
    onehot = np.eye(C)[y]
    ls = np.linalg.lstsq(x, onehot, rcond=None)[0]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    for parts in (1, 2, 7):  # the same rows, split otherwise
        split = np.array_split(order, parts)
        again = [(x[i].astype(np.float32), y[i], clients[0][2], clients[0][3]) for i in split]
        w = _run(again, C, gamma=0.5).server_state.weight.numpy()
        np.testing.assert_allclose(w, ls, rtol=1e-6, atol=1e-8)
    lam = 0.3  # with lam the pooled ridge regression
    ridge = np.linalg.solve(x.T @ x + lam * np.eye(x.shape[1]), x.T @ onehot)
    np.testing.assert_allclose(_run(clients, C, lam=lam).server_state.weight.numpy(), ridge, rtol=1e-8, atol=1e-10)
    # without the cleaning: the ridge with the K gamma the clients added
    kg = len(clients) * 1.0
    np.testing.assert_allclose(_run(clients, C, clean=False).server_state.weight.numpy(),
                               np.linalg.solve(x.T @ x + kg * np.eye(x.shape[1]), x.T @ onehot), rtol=1e-8, atol=1e-10)


def test_fewer_rows_than_dimensions_is_solved_stably_and_said(caplog):
    """12 rows of 20-d features: the cleaned system is singular. The stable solve is the minimum-norm
    least squares (a note says so); the literal one inverts it as the authors' code does."""
    C = 3
    clients = few_rows(20, C, rows=4)
    x, y = pooled(clients)
    stable = _run(clients, C)
    assert bool(stable.server_state.pinv)
    np.testing.assert_allclose(stable.server_state.weight.numpy(), np.linalg.pinv(x.T @ x) @ x.T @ np.eye(C)[y],
                               rtol=1e-6, atol=1e-8)
    alg = create_algorithm("afl")
    (note,) = alg.trained_notes(stable.server_state, ["a", "b", "c"])
    assert "singular" in note and "pseudo-inverse" in note and "solve=literal" in note
    assert float(stable.final_accuracy().mean()) > 0.8
    literal = _run(clients, C, solve="literal")
    assert not bool(literal.server_state.pinv)
    minnorm = stable.server_state.weight
    # the inverse of a singular matrix: far from every least-squares solution's minimum-norm one, and worse
    assert float((literal.server_state.weight - minnorm).norm()) > 10 * float(minnorm.norm())
    assert float(literal.final_accuracy().mean()) < float(stable.final_accuracy().mean())


def test_afl_is_fed3r_without_its_bias_before_the_normalisation():
    clients, C = federation(seed=2, M=5, C=6, D=5)
    afl = _run(clients, C, lam=0.01).server_state
    fed3r = run(create_algorithm("fed3r", bias=False, lam=0.01), from_arrays(clients, C), 1, seed=0,
                progress=False).server_state
    w = afl.weight.T[fed3r.present]
    torch.testing.assert_close(torch.nn.functional.normalize(w, dim=-1), fed3r.weight[fed3r.present], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("engine", ["vectorized", "loop"])
def test_partial_participation_reaches_the_one_round_head(engine):
    clients, C = federation(seed=5, M=6, C=6, D=5)
    full = _run(clients, C, engine=engine).server_state.weight
    part = _run(clients, C, engine=engine, rounds=12, fraction=0.5).server_state
    assert int(part.clients) == 6
    torch.testing.assert_close(part.weight, full, rtol=1e-8, atol=1e-10)


def test_secure_form_gives_the_plain_head():
    clients, C = federation(seed=6, M=4, C=6, D=5)
    data = from_arrays(clients, C)
    alg = create_algorithm("afl")
    init = alg.init(data.spec(), seed=0)
    ctx = RoundCtx(0, 0, torch.arange(4), 4)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx)
    plain, _ = alg.server_aggregate(init.server_state, msg, ctx)
    form = alg.secure_form(msg)
    rows = [form.sums(type(msg)(msg.weight[i:i + 1], msg.corr[i:i + 1], msg.fresh[i:i + 1])) for i in range(4)]
    tot = {k: sum(r[k] for r in rows) for k in rows[0]}
    secure, _ = form.aggregate(init.server_state, None, tot, ctx)
    torch.testing.assert_close(secure.weight, plain.weight, rtol=1e-9, atol=1e-11)
    assert int(secure.clients) == 4


def test_under_dp_the_head_is_private_and_close_under_vanishing_noise():
    from fedheads.privacy import Mechanism, Private

    clients, C = federation(seed=7, M=5, C=6, D=5)
    data = from_arrays(clients, C)
    big = run(Private(create_algorithm("afl"), Mechanism(noise_multiplier=1e-9, clip=100.0, noise_seed=1)), data, 1,
              seed=0, progress=False)
    plain = _run(clients, C)
    torch.testing.assert_close(big.server_state.weight, plain.server_state.weight, rtol=1e-5, atol=1e-6)
    noisy = Private(create_algorithm("afl"), Mechanism(epsilon=1.0, noise_seed=2))
    res = run(noisy, data, 1, seed=0, progress=False)
    report = noisy.report([noisy.releases(res.client_state)])
    assert report["epsilon"] <= 1.0 + 1e-6 and "afl_noise_lam" in report["post_processing"]


def test_each_client_sends_its_solution_and_gram():
    """What is sent: W_k (D x C) and C_k (D x D) in float64, plus the one-integer fresh flag."""
    clients, C = federation(seed=8, M=3, C=6, D=5)
    res = _run(clients, C)
    D = 5
    assert res.history[0].comm.up_bytes == 3 * ((D * C + D * D) * 8 + 8)


def test_bad_settings_are_one_line():
    with pytest.raises(UserError, match="solve 'exact'"):
        AFLConfig(solve="exact")
    with pytest.raises(UserError, match="gamma -1"):
        AFLConfig(gamma=-1.0)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_summed_path_is_the_per_client_one(fraction):
    """message_budget=1: Σ C_k and Σ X_kᵀY_k from the pooled rows, without the local solves: the
    head of the per-client messages to float rounding, the bytes counted as they are."""
    clients, C = federation(seed=8, M=6, C=6, D=5)
    rounds = 1 if fraction == 1.0 else 12
    data = from_arrays(clients, C)
    a = run(create_algorithm("afl"), data, rounds, seed=0, fraction=fraction, progress=False)
    b = run(create_algorithm("afl"), data, rounds, seed=0, fraction=fraction, progress=False, message_budget=1)
    assert [h.comm for h in a.history] == [h.comm for h in b.history]
    torch.testing.assert_close(b.server_state.weight, a.server_state.weight, rtol=1e-7, atol=1e-9)
    assert int(b.server_state.clients) == int(a.server_state.clients) == 6
