"""The papers' baselines (fedrep, pfedme, perfedavg, solo, lp, mlp; their engine equivalence is in
tests/test_engine_equivalence.py with every other algorithm): one local
round checked against an independent torch.nn.functional reference, the server rules by hand,
FedNCM initialisation against numpy class means, measured communication, and the registry."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fed_tiny import tiny_fed

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig
from fedheads.algorithms.fedrep import FedRep, FedRepConfig
from fedheads.algorithms.lp import HeadTuning, LPConfig
from fedheads.algorithms.mlp import MLP, MLPConfig
from fedheads.algorithms.perfedavg import PerFedAvg, PerFedAvgConfig
from fedheads.algorithms.pfedme import PFedMe, PFedMeConfig
from fedheads.algorithms.server_opt import FedAdam, make_server_optimizer
from fedheads.algorithms.solo import Solo, SoloConfig
from fedheads.core import OptimizerConfig, RoundCtx, ServerSGD, payload_size, run
from fedheads.core.federation import FedData, LayoutConfig, to_layout
from fedheads.core.tree import tree_index, tree_leaves
from fedheads.run.load import from_arrays

SGD = lambda lr: OptimizerConfig("sgd", lr=lr, weight_decay=0.0)  # noqa: E731

# ---- an independent reference of the FedPCL Table 7 head (torch.nn.functional, one client) ----

def _ref_logits(p: dict, b: dict, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict]:
    rm, rv = b["bn.running_mean"].clone(), b["bn.running_var"].clone()
    h = F.relu(F.linear(x, p["proj.weight"].T, p["proj.bias"]))
    h = F.batch_norm(h, rm, rv, p["bn.weight"], p["bn.bias"], training=train, momentum=0.1, eps=1e-5)
    return F.linear(F.normalize(h, dim=-1), p["cls.weight"].T, p["cls.bias"]), {"bn.running_mean": rm, "bn.running_var": rv}


def _ref_grad(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor, train: bool = True, keys=None):
    leaf = {k: v.detach().clone().requires_grad_(keys is None or k in keys) for k, v in p.items()}
    out, nb = _ref_logits(leaf, b, x, train)
    ks = [k for k in leaf if keys is None or k in keys]
    g = torch.autograd.grad(F.cross_entropy(out, y), [leaf[k] for k in ks])
    return dict(zip(ks, g)), nb


def _one_client(alg, data: FedData):
    """(init, its client 0 state/broadcast, client 0's x, y, and client_update's result)."""
    init = alg.init(data.spec(), 0)
    sub = data.select([0])
    cs = tree_index(init.client_state, torch.tensor([0]))
    out = alg.client_update(cs, init.broadcast, sub, RoundCtx(0, 0, torch.tensor([0]), data.num_clients))
    n = sub.n_train[0]
    return init, sub.x_train[0, :n], sub.y_train[0, :n], out


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_pfedme_one_batch_matches_reference() -> None:
    cfg = PFedMeConfig(hidden=8, batch_size=64, K=3, lam=15.0, personal_lr=0.05, lr=0.01, normalize=True)
    init, x, y, (cs, msg) = _one_client(PFedMe(cfg), tiny_fed())
    w = {k: v.clone() for k, v in init.broadcast.params.items()}
    theta, b = dict(w), dict(init.broadcast.buffers)
    for _ in range(cfg.K):  # Alg. 1 line 7: theta <- theta - plr (grad f + lam (theta - w))
        g, b = _ref_grad(theta, b, x, y)
        theta = {k: theta[k] - cfg.personal_lr * (g[k] + cfg.lam * (theta[k] - w[k])) for k in theta}
    w_new = {k: w[k] - cfg.lr * cfg.lam * (w[k] - theta[k]) for k in w}  # Alg. 1 line 8
    for k in w:
        _close(cs.theta[k][0], theta[k])
        _close(msg.delta[k][0], w_new[k] - w[k])
    _close(cs.buffers["bn.running_mean"][0], b["bn.running_mean"])
    # server: w <- (1 - beta) w + beta * weighted mean(w_i)
    alg = PFedMe(PFedMeConfig(beta=2.0))
    ss = type(init.server_state)({"a": torch.tensor([1.0])}, {})
    m = type(msg)({"a": torch.tensor([[1.0], [-2.0]])}, {}, torch.tensor([3.0, 1.0]))
    new, _ = alg.server_aggregate(ss, m, RoundCtx(0, 0, torch.arange(2), 2))
    assert float(new.params["a"]) == pytest.approx(1.0 + 2.0 * (3 * 1.0 - 2.0) / 4)  # = 1.5


def test_perfedavg_fo_step_and_personalisation_match_reference() -> None:
    cfg = PerFedAvgConfig(hidden=8, batch_size=64, alpha=0.3, optimizer=SGD(0.2))
    init, x, y, (cs, msg) = _one_client(PerFedAvg(cfg), tiny_fed())
    w, b0 = init.broadcast.params, init.broadcast.buffers
    g_eval, _ = _ref_grad(w, b0, x, y, train=False)
    g1, b1 = _ref_grad(w, b0, x, y)  # batch D = all rows (batch_size > n)
    tmp = {k: w[k] - cfg.alpha * g1[k] for k in w}
    g2, b2 = _ref_grad(tmp, b1, x, y)  # batch D'
    alg = PerFedAvg(cfg)
    alg.init(tiny_fed().spec(), 0)
    adapted = alg.adapt_for_eval(cs, init.server_state, tiny_fed().select([0]))  # the eval-time hook
    for k in w:
        _close(adapted.personal[k][0], w[k] - cfg.alpha * g_eval[k])  # one-step personalisation
        _close(msg.delta[k][0], -0.2 * g2[k])  # FO: gradient at w_tmp applied to w
    _close(msg.buffer_delta["bn.running_var"][0], b2["bn.running_var"] - b0["bn.running_var"])


@pytest.mark.parametrize("engine", ["vectorized", "loop"])
def test_perfedavg_evaluates_the_current_global_model_adapted(engine: str) -> None:
    # PFLlib adapts the model the server holds NOW; adapting the one received before the last
    # round would report the previous round's global model
    cfg = PerFedAvgConfig(hidden=8, batch_size=4, alpha=0.3)
    data = tiny_fed()
    res = run(PerFedAvg(cfg), data, rounds=2, seed=0, engine=engine, progress=False)
    alg = PerFedAvg(cfg)
    alg.init(data.spec(), 0)
    for i in range(data.num_clients):
        sub = data.select([i])
        n = sub.n_train[0]
        g, _ = _ref_grad(res.server_state.params, res.server_state.buffers, sub.x_train[0, :n], sub.y_train[0, :n], train=False)
        for k, v in res.client_state.personal.items():
            _close(v[i], res.server_state.params[k] - cfg.alpha * g[k])
    scores = alg.predict(res.client_state, res.server_state, data.x_test, data.m_test)["main"]
    from fedheads.core.ops import masked_accuracy
    torch.testing.assert_close(masked_accuracy(scores, data.y_test, data.m_test).cpu(), res.final_accuracy(),
                               equal_nan=True)


def test_fedrep_head_then_representation_matches_reference() -> None:
    cfg = FedRepConfig(hidden=8, batch_size=64, head_epochs=1, rep_epochs=1, optimizer=SGD(0.5))
    init, x, y, (cs, msg) = _one_client(FedRep(cfg), tiny_fed())
    p0 = {**init.broadcast.params, **{k: init.client_state.params[k][0] for k in ("cls.weight", "cls.bias")}}
    head_keys = {"cls.weight", "cls.bias"}
    gh, b1 = _ref_grad(p0, init.broadcast.buffers, x, y, keys=head_keys)
    p1 = {k: (p0[k] - 0.5 * gh[k]) if k in head_keys else p0[k] for k in p0}
    gr, _ = _ref_grad(p1, b1, x, y, keys=set(init.broadcast.params))
    assert set(msg.delta) == set(init.broadcast.params)  # only the representation is uploaded
    for k in init.broadcast.params:
        _close(msg.delta[k][0], -0.5 * gr[k])
    for k in head_keys:
        _close(cs.params[k][0], p1[k])


def test_solo_communicates_nothing_and_clients_are_independent() -> None:
    data = tiny_fed()
    res = run(Solo(SoloConfig(hidden=8, batch_size=4)), data, rounds=2, seed=1, progress=False)
    assert res.total_comm().up_values == res.total_comm().down_values == res.upload_values_per_client == 0
    x = data.x_train.clone()
    x[0] = x[0] * 3 + 1  # another client's data changes ...
    other = run(Solo(SoloConfig(hidden=8, batch_size=4)), dataclasses.replace(data, x_train=x), rounds=2,
                seed=1, progress=False)
    for k, v in res.client_state.params.items():  # ... client 2's model does not
        torch.testing.assert_close(other.client_state.params[k][2], v[2], atol=0, rtol=0)
    assert not torch.equal(other.client_state.params["cls.weight"][0], res.client_state.params["cls.weight"][0])
    assert not torch.equal(res.client_state.params["cls.weight"][0], res.client_state.params["cls.weight"][1])


def test_fedadam_server_step_by_hand() -> None:
    opt = FedAdam(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3, flavour="reddi")
    assert opt.weight_decay == 0.0
    w = {"a": torch.tensor([1.0, 1.0], dtype=torch.float64)}
    st = opt.init(w)
    w1, st = opt.step(w, {"a": torch.tensor([0.1, -0.2], dtype=torch.float64)}, st)
    # m = 0.1*Delta; v = 0.99*tau^2 + 0.01*Delta^2; w + 0.1 m / (sqrt(v) + tau)
    for i, d in enumerate((0.1, -0.2)):
        m, v = 0.1 * d, 0.99e-6 + 0.01 * d * d
        assert float(w1["a"][i]) == pytest.approx(1.0 + 0.1 * m / (math.sqrt(v) + 1e-3), rel=1e-12)
    w2, _ = opt.step(w1, {"a": torch.zeros(2, dtype=torch.float64)}, st)  # momentum keeps moving
    assert float(w2["a"][0]) > float(w1["a"][0])
    assert isinstance(make_server_optimizer("fedprox"), ServerSGD)
    with pytest.raises(UserError, match="server_opt"):
        make_server_optimizer("fedyogi")
    with pytest.raises(UserError, match="adam_flavour"):
        make_server_optimizer("fedadam", flavour="yogi")


def test_fedadam_flsim_flavour_is_torch_adam_on_minus_delta() -> None:
    # FLSim: torch.optim.Adam(lr, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-5) stepping on
    # the pseudo-gradient g = -Delta. First step by hand: m_hat = g + wd w, v_hat = m_hat^2, so
    # w1 = w - lr * m_hat / (|m_hat| + eps) = w - lr * sign(m_hat) (for |m_hat| >> eps)
    opt = make_server_optimizer("fedadam", lr=1e-3)
    assert (opt.flavour, opt.beta2, opt.tau, opt.weight_decay) == ("flsim", 0.999, 1e-8, 1e-5)
    w = {"a": torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)}
    deltas = [torch.tensor([0.1, -2e-4, 3e-6], dtype=torch.float64),
              torch.tensor([-0.05, 1e-3, 0.0], dtype=torch.float64),
              torch.tensor([0.2, 0.0, -1e-2], dtype=torch.float64)]
    st = opt.init(w)
    w1, st1 = opt.step(w, {"a": deltas[0]}, st)
    g = -deltas[0] + 1e-5 * w["a"]
    torch.testing.assert_close(w1["a"], w["a"] - 1e-3 * g / (g.abs() + 1e-8), rtol=1e-12, atol=1e-15)
    # ... and several steps against torch itself
    ref = torch.nn.Parameter(w["a"].clone())
    topt = torch.optim.Adam([ref], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-5)
    cur, st = w, opt.init(w)
    for d in deltas:
        ref.grad = -d.clone()
        topt.step()
        cur, st = opt.step(cur, {"a": d}, st)
        torch.testing.assert_close(cur["a"], ref.detach(), rtol=1e-12, atol=1e-15)
    # the Reddi flavour's first step at Delta = tau is eta / 20, not eta
    red = make_server_optimizer("fedadam", lr=1e-3, flavour="reddi")
    r1, _ = red.step({"a": torch.zeros(1, dtype=torch.float64)}, {"a": torch.full((1,), 1e-3, dtype=torch.float64)},
                     red.init({"a": torch.zeros(1, dtype=torch.float64)}))
    assert float(r1["a"][0]) == pytest.approx(1e-3 / 20, rel=1e-9)


def test_lp_fedavg_equals_core_fedavg_linear_and_prox_zero_is_fedavg() -> None:
    data = tiny_fed()
    lp = run(HeadTuning(LPConfig(batch_size=4, optimizer=SGD(0.2))), data, rounds=2, seed=5, progress=False)
    core = run(FedAvg(FedAvgConfig(hidden=0, batch_size=4, optimizer=SGD(0.2))), data, rounds=2, seed=5, progress=False)
    for k in ("cls.weight", "cls.bias"):
        _close(lp.server_state.params[k], core.server_state.params[k])
    prox0 = run(HeadTuning(LPConfig(batch_size=4, optimizer=SGD(0.2), server_opt="fedprox", prox_mu=0.0)),
                data, rounds=2, seed=5, progress=False)
    torch.testing.assert_close(prox0.server_state.params["cls.weight"], lp.server_state.params["cls.weight"])
    far = {}
    for mu in (0.0, 5.0):
        alg = HeadTuning(LPConfig(batch_size=4, optimizer=SGD(0.2), server_opt="fedprox", prox_mu=mu))
        init = alg.init(data.spec(), 0)
        _, msg = alg.client_update(init.client_state, init.broadcast, data, RoundCtx(0, 0, torch.arange(4), 4))
        far[mu] = sum(float(v.norm()) for v in msg.delta.values())
    assert far[5.0] < far[0.0]


@pytest.mark.parametrize("layout", [None, LayoutConfig("bucketed", waste=1.0, bucket_clients=2)])
@pytest.mark.parametrize("reset", [True, False])
def test_lp_without_local_models_keeps_no_head_per_client_and_trains_the_same(layout, reset) -> None:
    """local_models=False: the client state holds no head (only the step counter, or the carried
    momentum with reset_optimizer=False), and the server model and its accuracies are those of LP
    with local heads, bit for bit, with partial participation and size buckets."""
    data = tiny_fed(M=6) if layout is None else to_layout(tiny_fed(M=6), layout)
    opt = OptimizerConfig("sgd", lr=0.2, momentum=0.0 if reset else 0.5)
    keep, drop = (run(HeadTuning(LPConfig(batch_size=4, optimizer=opt, reset_optimizer=reset, local_models=lm)),
                      data, rounds=3, seed=5, fraction=0.5, progress=False) for lm in (True, False))
    for k, v in keep.server_state.params.items():
        assert torch.equal(v, drop.server_state.params[k])
    for a, b in zip(keep.history, drop.history):
        assert a.comm == b.comm and set(a.accuracy) == {"main", "global_model", "local_model"}
        assert set(b.accuracy) == {"main", "global_model"}
        for rule in b.accuracy:
            torch.testing.assert_close(a.accuracy[rule], b.accuracy[rule], rtol=0, atol=0, equal_nan=True)
    C, D = data.num_classes, data.dim
    assert keep.trainable_params_per_client == drop.trainable_params_per_client == D * C + C
    assert drop.client_state.params == {} and keep.client_state.params["cls.weight"].shape == (6, D, C)
    if reset:  # nothing per client but the [M] step counter
        assert [t.shape for t in tree_leaves(drop.client_state)] == [(6,)]
    else:  # the carried momentum is per client by nature, and the same either way
        for k, v in keep.client_state.opt.m.items():
            assert torch.equal(v, drop.client_state.opt.m[k])
    with pytest.raises(UserError, match="local_models 'false'"):
        LPConfig(local_models="false")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [None, LayoutConfig("bucketed", waste=1.0, bucket_clients=2)])
@pytest.mark.parametrize("reset", [True, False])
def test_fedavg_without_local_models_keeps_no_model_per_client_and_trains_the_same(layout, reset) -> None:
    """FedAvg's local_models=False, as LP's: the client state holds no model (only the step
    counter, or the carried moments with reset_optimizer=False), and the global model (its BN
    statistics too) and its accuracies are those with local models, bit for bit, with partial
    participation and size buckets."""
    data = tiny_fed(M=6) if layout is None else to_layout(tiny_fed(M=6), layout)
    keep, drop = (run(FedAvg(FedAvgConfig(hidden=8, batch_size=4, reset_optimizer=reset, local_models=lm)),
                      data, rounds=3, seed=5, fraction=0.5, progress=False) for lm in (True, False))
    for part in ("params", "buffers"):
        for k, v in getattr(keep.server_state, part).items():
            assert torch.equal(v, getattr(drop.server_state, part)[k]), k
    for a, b in zip(keep.history, drop.history):
        assert a.comm == b.comm and set(a.accuracy) == {"main", "global_model", "local_model"}
        assert set(b.accuracy) == {"main", "global_model"}
        for rule in b.accuracy:
            torch.testing.assert_close(a.accuracy[rule], b.accuracy[rule], rtol=0, atol=0, equal_nan=True)
    assert keep.trainable_params_per_client == drop.trainable_params_per_client > 0
    assert drop.client_state.params == {} == drop.client_state.buffers
    if reset:  # nothing per client but the [M] step counter
        assert [t.shape for t in tree_leaves(drop.client_state)] == [(6,)]
    else:  # the carried moments are per client by nature, and the same either way
        for a, b in zip(tree_leaves(keep.client_state.opt), tree_leaves(drop.client_state.opt), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(UserError, match="local_models 'false'"):
        FedAvg(FedAvgConfig(local_models="false"))  # type: ignore[arg-type]


def test_lp_predict_reads_the_global_head_without_a_copy_per_client() -> None:
    """Evaluation groups hold thousands of small clients at a real federation's scale: predict
    must not copy the C x (D+1) global head once per client (it allocates only the scores)."""
    from torch.profiler import ProfilerActivity, profile

    from fedheads.algorithms.lp import HeadClientState, HeadServerState, init_mlp

    M, N, D, C = 400, 2, 64, 50
    ss = HeadServerState(init_mlp(D, (), C, 0), None, True)
    alg = HeadTuning(LPConfig(local_models=False))
    x, mask = torch.randn(M, N, D), torch.ones(M, N, dtype=torch.bool)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = alg.predict(HeadClientState({}, None), ss, x, mask)  # type: ignore[arg-type]
    allocated = sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0)
    assert set(out) == {"main", "global_model"} and out["main"].shape == (M, N, C)
    assert allocated < M * (D + 1) * C * 4 // 4  # scores [M, N, C] only, no [M, D+1, C] copy
    torch.testing.assert_close(out["main"], x @ ss.params["cls.weight"] + ss.params["cls.bias"])


def _pooled_means(data: FedData, feats: torch.Tensor) -> np.ndarray:
    x = feats[data.m_train].double().numpy()
    y = data.y_train[data.m_train].numpy()
    return np.stack([x[y == c].mean(0) for c in range(data.num_classes)])


def test_lp_fedncm_round_sets_normalised_class_means() -> None:
    data = tiny_fed()
    res = run(HeadTuning(LPConfig(init="fedncm")), data, rounds=1, seed=0, progress=False)
    means = _pooled_means(data, data.x_train)
    want = means / np.linalg.norm(means, axis=1, keepdims=True)
    np.testing.assert_allclose(res.server_state.params["cls.weight"].T.numpy(), want, atol=1e-6)
    assert not res.server_state.params["cls.bias"].any()
    C, D = data.num_classes, data.dim
    assert res.history[0].comm.up_values == 4 * (C * D + C)  # sums + counts, nothing else
    assert res.history[0].comm.down_values == 0  # LP clients use raw features: the initial head is not needed
    assert res.trainable_params_per_client == D * C + C
    from fedheads.algorithms.fedncm import FedNCM  # the same head predicts as FedNCM's cosine rule

    ncm = run(FedNCM(), data, rounds=1, seed=0, progress=False)
    torch.testing.assert_close(res.final_accuracy(), ncm.final_accuracy(), equal_nan=True)


def test_mlp_fedncm_initialises_last_layer_from_hidden_means() -> None:
    data = tiny_fed()
    res = run(MLP(MLPConfig(hidden=(5, 7), init="fedncm", ncm_bias="random")), data, rounds=1, seed=0, progress=False)
    p = res.server_state.params
    h = torch.relu(torch.relu(data.x_train @ p["fc0.weight"] + p["fc0.bias"]) @ p["fc1.weight"] + p["fc1.bias"])
    means = _pooled_means(data, h)
    want = means / np.linalg.norm(means, axis=1, keepdims=True)
    np.testing.assert_allclose(p["cls.weight"].T.numpy(), want, atol=1e-6)
    assert p["cls.bias"].abs().max() <= 1 / math.sqrt(7) and p["cls.bias"].any()  # nn.Linear's bias kept
    assert res.trainable_params_per_client == (6 * 5 + 5) + (5 * 7 + 7) + (7 * 3 + 3)
    with pytest.raises(UserError, match="two hidden"):
        MLPConfig(hidden=(8,))


def test_measured_communication_with_fedpcl_table2_shapes() -> None:
    """K = 1 backbone (d = 512), C = 10: FedPCL Table 2 counts FC weights only (131,072 for FedRep,
    133,632 for FedAvg-style heads); the engine logs everything actually sent."""
    rs = np.random.default_rng(0)
    clients = [(rs.normal(size=(12, 512)).astype("f4"), np.arange(12) % 10,
                rs.normal(size=(4, 512)).astype("f4"), np.arange(4) % 10) for _ in range(2)]
    data = from_arrays(clients, 10)
    ctx = RoundCtx(0, 0, torch.arange(2), 2)
    proj, bn, cls = 512 * 256 + 256, 2 * 256, 256 * 10 + 10
    expect = {"fedrep": proj + bn + bn + 1, "pfedme": proj + bn + cls + bn + 1,
              "perfedavg": proj + bn + cls + bn + 1, "solo": 0}
    algs = {"fedrep": FedRep(FedRepConfig(head_epochs=1)), "pfedme": PFedMe(PFedMeConfig(K=1)),
            "perfedavg": PerFedAvg(), "solo": Solo()}
    for name, alg in algs.items():
        init = alg.init(data.spec(), 0)
        assert alg.trainable_params(init.client_state) == proj + bn + cls
        _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx)
        assert payload_size(msg)[0] == expect[name], name
    assert expect["fedrep"] - 256 - bn - bn - 1 == 131_072  # the paper's count: the FC weight alone


def test_fedncm_init_round_downloads_only_what_clients_use() -> None:
    # LP's FedNCM round needs no weights (clients send raw-feature statistics); the MLP's needs
    # its hidden layers (the last layer's input), never the classifier being replaced
    from fedheads.core import count_parameters

    data = tiny_fed(M=3, D=6, C=3)
    lp = run(HeadTuning(LPConfig(init="fedncm", batch_size=4)), data, rounds=2, seed=0, progress=False)
    assert lp.history[0].comm.down_values == 0
    assert lp.history[1].comm.down_values == 3 * (6 * 3 + 3)
    mlp = run(MLP(MLPConfig(hidden=(5, 4), init="fedncm", batch_size=4)), data, rounds=1, seed=0, progress=False)
    assert mlp.history[0].comm.down_values == 3 * ((6 * 5 + 5) + (5 * 4 + 4))
    pc = count_parameters(HeadTuning(LPConfig(init="fedncm")), data)  # steady state: after round 0
    assert (pc.upload_per_client, pc.download_per_client) == (6 * 3 + 3 + 1, 6 * 3 + 3)  # + n_i


def test_registry_builds_every_baseline() -> None:
    for name in ("fedrep", "pfedme", "perfedavg", "solo", "lp", "mlp"):
        __import__(f"fedheads.algorithms.{name}")
    lp = create_algorithm("lp", server_opt="fedadam", server_lr=1e-4, lr=0.1, init="fedncm")
    assert lp.name == "lp" and isinstance(lp.server_opt, FedAdam) and lp.server_opt.lr == 1e-4
    assert lp.cfg.optimizer.lr == 0.1 and lp.cfg.optimizer.name == "sgd"
    assert create_algorithm("mlp", hidden="64").cfg.hidden == (64, 64)
    assert create_algorithm("pfedme", lr=0.01).cfg.lr == 0.01  # pFedMe's own eta
    assert create_algorithm("fedrep", lr=0.01, head_epochs=3).cfg.optimizer.lr == 0.01
    assert create_algorithm("perfedavg").cfg.alpha == 0.005 and create_algorithm("solo").name == "solo"
    assert create_algorithm("mlp", hidden=[32, 16]).cfg.hidden == (32, 16)
    with pytest.raises(TypeError, match="bogus"):  # the runner reports it as "does not apply"
        create_algorithm("fedrep", bogus=1)
    with pytest.raises(TypeError, match="local_epochs"):  # FedRep has head_epochs / rep_epochs
        create_algorithm("fedrep", local_epochs=2)
    with pytest.raises(UserError, match="server_opt"):
        create_algorithm("lp", server_opt="sgd")


@pytest.mark.parametrize("name", ["fedrep", "pfedme", "perfedavg", "solo"])
def test_personalised_baselines_learn_separable_clusters(name: str) -> None:
    adam = OptimizerConfig(lr=0.05)
    alg = {"fedrep": lambda: FedRep(FedRepConfig(hidden=8, batch_size=16, head_epochs=2, optimizer=adam)),
           "pfedme": lambda: PFedMe(PFedMeConfig(hidden=8, batch_size=16, K=3, lam=1.0, lr=1.0, personal_lr=0.3)),
           "perfedavg": lambda: PerFedAvg(PerFedAvgConfig(hidden=8, batch_size=16, alpha=0.05, optimizer=adam)),
           "solo": lambda: Solo(SoloConfig(hidden=8, batch_size=16, local_epochs=2, optimizer=adam))}[name]()
    res = run(alg, tiny_fed(M=3, seed=1), rounds=5, seed=0, progress=False)
    assert float(res.final_accuracy().mean()) > 0.6  # chance is 1/3


def test_cli_trains_baselines_from_a_store(tmp_path) -> None:
    import json

    from click.testing import CliRunner

    from embedcache.store.importer import import_features
    from fedheads.cli import main

    rs = np.random.default_rng(0)
    centers = rs.normal(size=(3, 6)) * 2
    for ci in range(2):
        for split, n in (("train", 20), ("test", 10)):
            y = rs.integers(0, 3, n)
            np.savez(tmp_path / f"{ci}{split}.npz", features=(centers[y] + rs.normal(size=(n, 6))).astype("f4"), labels=y)
            import_features(tmp_path / "st.zarr", tmp_path / f"{ci}{split}.npz", backbone="b", client=f"c{ci}",
                            split=split, domain=f"d{ci}", classes=["x", "y", "z"])
    for name, extra in (("fedrep", ["--set", "head_epochs=2"]),
                        ("lp", ["--set", "server_opt=fedadam", "--set", "init=fedncm", "--lr", "0.1"])):
        out = tmp_path / name
        r = CliRunner().invoke(main, ["train", "--store", str(tmp_path / "st.zarr"), "--backbones", "b",
                                      "--algorithm", name, "--rounds", "2", "--seeds", "0", "--quiet",
                                      "--out", str(out), *extra], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        res = json.loads((out / "results.json").read_text())
        assert res["algorithm"] == name and res["trainable_params_per_client"] > 0
    cfg = json.loads((out / "config.json").read_text())["algorithm_config"]
    assert cfg["server_opt"] == "fedadam" and cfg["init"] == "fedncm"
    r = CliRunner().invoke(main, ["train", "--store", str(tmp_path / "st.zarr"), "--backbones", "b", "--algorithm",
                                  "fedrep", "--local-epochs", "2", "--quiet", "--out", str(tmp_path / "bad")])
    assert r.exit_code == 2 and "does not apply" in r.output
