"""FedProto: count-weighted or plain-mean aggregation from sums, the CE + lambda*MSE loss, inference rules."""

from __future__ import annotations

import pytest
import torch
from fed_tiny import tiny_fed

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms.fedproto import FedProto, FedProtoBroadcast, FedProtoConfig, FedProtoMessage
from fedheads.core import OptimizerConfig, RoundCtx, heads, run


def test_server_weighted_prototypes_by_hand_and_keeps_missing() -> None:
    alg = FedProto(FedProtoConfig(hidden=2))
    init = alg.init(tiny_fed(M=2, D=3, C=3).spec(), 0)
    # client 0: class 0 proto [1,0] x1 ; client 1: class 0 proto [0,1] x3 ; class 1 proto [1,1] x2
    sums = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], [[0.0, 3.0], [2.0, 2.0], [0.0, 0.0]]])
    counts = torch.tensor([[1.0, 0.0, 0.0], [3.0, 2.0, 0.0]])
    ss, bc = alg.server_aggregate(init.server_state, FedProtoMessage(sums, counts), RoundCtx(0, 0, torch.arange(2), 2))
    torch.testing.assert_close(ss.global_protos[:2], torch.tensor([[0.25, 0.75], [1.0, 1.0]]))
    assert ss.global_present.tolist() == [True, True, False]
    # next round only client 0 participates with class 0 -> class 1 keeps its prototype
    ss2, _ = alg.server_aggregate(ss, FedProtoMessage(sums[:1] * 2, counts[:1] * 2), RoundCtx(1, 0, torch.tensor([0]), 2))
    torch.testing.assert_close(ss2.global_protos[:2], torch.tensor([[1.0, 0.0], [1.0, 1.0]]))


def test_mean_aggregation_is_the_authors_unweighted_mean() -> None:
    data = tiny_fed(M=2, D=3, C=3)
    ctx = RoundCtx(0, 0, torch.arange(2), 2)
    out = {}
    for agg in ("weighted", "mean"):
        alg = FedProto(FedProtoConfig(hidden=4, aggregation=agg))
        init = alg.init(data.spec(), 0)
        cs, msg = alg.client_update(init.client_state, init.broadcast, data, ctx)
        out[agg] = (cs, alg.server_aggregate(init.server_state, msg, ctx)[0])
    cs, ss = out["mean"]
    pres = cs.present.to(torch.float32)  # proto_aggregation: sum of the clients' protos / their number
    want = (pres.unsqueeze(-1) * cs.protos).sum(0) / pres.sum(0).clamp_min(1).unsqueeze(-1)
    torch.testing.assert_close(ss.global_protos, want)
    n = torch.tensor(data.n_train)
    assert n[0] != n[1] and not torch.allclose(out["weighted"][1].global_protos, want)
    with pytest.raises(Exception, match="aggregation"):
        FedProtoConfig(aggregation="median")


def test_loss_is_ce_plus_lambda_mse() -> None:
    data = tiny_fed(M=1, D=4, C=3)
    for lam in (0.0, 2.0):
        cfg = FedProtoConfig(hidden=4, lam=lam, batch_size=1000, optimizer=OptimizerConfig("sgd", lr=1.0, weight_decay=0.0))
        alg = FedProto(cfg)
        init = alg.init(data.spec(), 0)
        gp = torch.randn(3, 4)
        bc = FedProtoBroadcast(gp, torch.tensor([True, True, False]))
        cs = init.client_state
        # one full-batch SGD step with lr 1 moves params by -grad(L); compare with autograd of the formula
        new, _ = alg.client_update(cs, bc, data, RoundCtx(0, 0, torch.tensor([0]), 1))
        p = {k: v.clone().requires_grad_(True) for k, v in cs.params.items()}
        z, _ = heads.embed(heads.spec_of(p, alg.cfg.normalize), p, cs.buffers, data.x_train, data.m_train, train=True)
        n = data.n_train[0]
        zt, yt = z[0, :n], data.y_train[0, :n]
        ce = torch.nn.functional.cross_entropy(heads.classify(p, z)[0, :n], yt)
        keep = bc.global_present[yt]
        mse = torch.where(keep.unsqueeze(-1), (zt - gp[yt]) ** 2, torch.zeros_like(zt)).mean()
        (ce + lam * mse).backward()
        for k in p:
            torch.testing.assert_close(new.params[k], (p[k] - p[k].grad).detach(), atol=1e-5, rtol=1e-4)


def test_learns_and_reports_three_rules() -> None:
    data = tiny_fed(M=3, seed=1)
    cfg = FedProtoConfig(hidden=8, batch_size=8, local_epochs=2, optimizer=OptimizerConfig(lr=0.03))
    res = run(FedProto(cfg), data, rounds=5, seed=0, progress=False)
    acc = res.history[-1].accuracy
    assert set(acc) == {"main", "global_protos", "local_protos"}
    assert float(acc["main"].mean()) > 0.7  # chance is 1/3
    C, d = data.num_classes, 8
    assert res.upload_values_per_client == C * d + C
    assert res.trainable_params_per_client == data.dim * d + d + 2 * d + d * C + C


def test_registry_and_bad_config() -> None:
    alg = create_algorithm("fedproto", lam=0.5, lr=0.01)
    assert alg.cfg.lam == 0.5 and alg.cfg.optimizer.lr == 0.01
    with pytest.raises(UserError, match="lam >= 0"):
        FedProtoConfig(lam=-1.0)
