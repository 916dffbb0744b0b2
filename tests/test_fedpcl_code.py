"""FedPCL `variant="code"` against a tiny transcription of the authors' code (GitHub
yuetan031/FedPCL): the ProjandDeci head (fc1 -> ReLU -> L2, no BatchNorm), ConLoss summed over the
clients' prototype sets, round 0's Adam steps on a zero loss plus weight decay, drop_last batches,
and inference with the noised prototypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedheads.algorithms.fedpcl import FedPCL, FedPCLBroadcast, FedPCLConfig
from fedheads.core import RoundCtx, heads, run
from fedheads.core.federation import FedData
from fedheads.run.load import from_arrays

D, H, C = 5, 4, 3


def _data(n: int = 10, seed: int = 0) -> FedData:
    rs = np.random.default_rng(seed)
    x = rs.normal(size=(n, D)).astype("f4")
    y = np.arange(n) % C
    return from_arrays([(x, y, x[:3], y[:3])], C)


def _authors_head(p: dict[str, torch.Tensor]) -> torch.nn.Linear:
    """ProjandDeci.fc1 with our client-0 weights (ours are stored transposed, [Din, Dout])."""
    fc1 = torch.nn.Linear(D, H)
    with torch.no_grad():
        fc1.weight.copy_(p["proj.weight"][0].T)
        fc1.bias.copy_(p["proj.bias"][0])
    return fc1


def _authors_z(fc1: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.normalize(F.relu(fc1(x)), dim=1)  # ProjandDeci.forward's x1


def _authors_conloss(features: torch.Tensor, labels: torch.Tensor, protos: torch.Tensor,
                     temperature: float = 0.07, base_temperature: float = 0.07) -> torch.Tensor:
    """lib/losses.py ConLoss.forward, contrast_mode='all', transcribed line by line."""
    batch_size = features.shape[0]
    mask = torch.eq(labels.view(-1, 1), labels.view(1, -1)).float()
    contrast_count = features.shape[1]
    contrast_feature = torch.cat(torch.unbind(features, dim=1), dim=0)
    anchor_count = contrast_count
    anchor_feature = torch.stack([protos[int(labels[i % batch_size])] for i in range(batch_size * anchor_count)])
    logits = anchor_feature @ contrast_feature.T / temperature
    logits = logits - logits.max(dim=1, keepdim=True).values.detach()
    mask = mask.repeat(anchor_count, contrast_count)
    logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(batch_size * anchor_count).view(-1, 1), 0)
    mask = mask * logits_mask
    exp_logits = torch.exp(logits) * logits_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
    mean_log_prob_pos = (mask * log_prob).sum(1) / mask.sum(1)
    return (-(temperature / base_temperature) * mean_log_prob_pos).view(anchor_count, batch_size).mean()


def _broadcast(sets: torch.Tensor) -> FedPCLBroadcast:
    S = sets.shape[0]
    return FedPCLBroadcast(False, sets, torch.ones(S, dtype=torch.bool), torch.ones(S, C, dtype=torch.bool),
                           sets.mean(0), torch.ones(C, dtype=torch.bool))


def test_code_head_is_fc_relu_l2_without_batchnorm() -> None:
    data = _data()
    code = FedPCL(FedPCLConfig(hidden=H, variant="code"))
    init = code.init(data.spec(), 0)
    p, b = init.client_state.params, init.client_state.buffers
    assert set(p) == {"proj.weight", "proj.bias"} and b == {}
    z, _ = heads.embed(code._spec(p), p, b, data.x_train, data.m_train, train=True)
    x = data.x_train[0, : data.n_train[0]]
    want = _authors_z(_authors_head(p), x)
    torch.testing.assert_close(z[0, : data.n_train[0]], want)
    assert bool((z >= 0).all())
    # the paper variant's Table 7 head (BN after the ReLU) on the same fc weights is another z
    paper = FedPCL(FedPCLConfig(hidden=H))
    pp = paper.init(data.spec(), 0).client_state
    torch.testing.assert_close(pp.params["proj.weight"], p["proj.weight"])
    zp, _ = heads.embed(paper._spec(pp.params), pp.params, pp.buffers, data.x_train, data.m_train, train=True)
    assert float((zp - z).abs().max()) > 0.05 and bool((zp < 0).any())
    # each difference is a field of its own
    assert FedPCL(FedPCLConfig(variant="code", batch_norm=True)).cfg.bn
    assert not FedPCLConfig(batch_norm=False).bn and FedPCLConfig(variant="code").drops_last


def test_code_loss_is_the_authors_conloss_summed_over_sets() -> None:
    data = _data(n=8, seed=1)
    alg = FedPCL(FedPCLConfig(hidden=H, variant="code"))
    init = alg.init(data.spec(), 0)
    p, b = init.client_state.params, init.client_state.buffers
    sets = torch.nn.functional.normalize(torch.rand(2, C, H, generator=torch.Generator().manual_seed(3)), dim=-1)
    x, y = data.x_train[:, :8], data.y_train[:, :8]
    loss, _ = alg._loss_fn(_broadcast(sets), alg._spec(p))(p, b, x, y, torch.ones(1, 8, dtype=torch.bool))
    z = _authors_z(_authors_head(p), x[0])
    feats = torch.stack([z, z], dim=1)  # images[0] and images[1]: two identical cached views
    want = sum(_authors_conloss(feats, y[0], sets[i]) for i in range(2))
    torch.testing.assert_close(loss[0], want)
    # the old head (BatchNorm) on the same weights gives another loss
    bn = FedPCL(FedPCLConfig(hidden=H, variant="code", batch_norm=True))
    ib = bn.init(data.spec(), 0).client_state
    lb, _ = bn._loss_fn(_broadcast(sets), bn._spec(ib.params))(ib.params, ib.buffers, x, y, torch.ones(1, 8, dtype=torch.bool))
    assert abs(float(lb[0].detach()) - float(want.detach())) > 1e-3


def _authors_round0(p: dict[str, torch.Tensor], x: torch.Tensor, batches: int) -> torch.nn.Linear:
    """update_weights_lg in round 0: loss = 0 * CE, Adam(lr 1e-3, weight_decay 1e-4) steps anyway."""
    fc1 = _authors_head(p)
    opt = torch.optim.Adam(fc1.parameters(), lr=1e-3, weight_decay=1e-4)
    for _ in range(batches):
        loss = 0 * _authors_z(fc1, x[:4]).sum()  # any batch: the gradient is exactly 0
        opt.zero_grad()
        loss.backward()
        opt.step()
    return fc1


@pytest.mark.parametrize("drop_last,batches", [(None, 2), (False, 3)])
def test_code_round0_adam_steps_on_weight_decay_with_drop_last(drop_last, batches) -> None:
    # 10 samples, batch 4: the authors' drop_last loader gives 2 batches, ours without it 3
    data = _data(n=10)
    alg = FedPCL(FedPCLConfig(hidden=H, batch_size=4, variant="code", drop_last=drop_last))
    init = alg.init(data.spec(), 0)
    cs, msg = alg.client_update(init.client_state, init.broadcast, data, RoundCtx(0, 0, torch.arange(1), 1))
    fc1 = _authors_round0(init.client_state.params, data.x_train[0], batches)
    torch.testing.assert_close(cs.params["proj.weight"][0], fc1.weight.detach().T, rtol=0, atol=1e-7)
    torch.testing.assert_close(cs.params["proj.bias"][0], fc1.bias.detach(), rtol=0, atol=1e-7)
    assert not torch.allclose(cs.params["proj.weight"], init.client_state.params["proj.weight"])
    # the round-0 prototypes come from the decayed head (Eq. 5 on the full training set)
    z = _authors_z(fc1, data.x_train[0, :10]).detach()
    y = data.y_train[0, :10]
    torch.testing.assert_close(msg.protos[0], torch.stack([z[y == j].mean(0) for j in range(C)]))


def test_paper_round0_trains_nothing_and_drop_last_starves_small_clients() -> None:
    data = _data(n=10)
    init_p = FedPCL(FedPCLConfig(hidden=H, batch_size=4)).init(data.spec(), 0)
    res = run(FedPCL(FedPCLConfig(hidden=H, batch_size=4)), data, rounds=1, seed=0, progress=False)
    torch.testing.assert_close(res.client_state.params, init_p.client_state.params, rtol=0, atol=0)
    # with drop_last a client with fewer samples than the batch size never takes a step
    small = FedPCL(FedPCLConfig(hidden=H, batch_size=16, variant="code"))
    init_s = small.init(data.spec(), 0)
    res = run(small, data, rounds=2, seed=0, progress=False)
    torch.testing.assert_close(res.client_state.params, init_s.client_state.params, rtol=0, atol=0)
    assert bool(res.client_state.present.any())  # prototypes still come from all 10 samples


def test_code_variant_infers_with_the_noised_prototypes() -> None:
    data = _data(n=10)
    ctx = RoundCtx(1, 0, torch.arange(1), 1)
    for variant, noisy in (("code", True), ("paper", False), ("code", False)):
        alg = FedPCL(FedPCLConfig(hidden=H, variant=variant, noise="laplace", noisy_inference=None if noisy else False))
        init = alg.init(data.spec(), 0)
        bc = FedPCLBroadcast(False, torch.zeros(1, C, H), torch.ones(1, dtype=torch.bool),
                             torch.ones(1, C, dtype=torch.bool), torch.zeros(C, H), torch.ones(C, dtype=torch.bool))
        cs, msg = alg.client_update(init.client_state, bc, data, ctx)
        assert torch.equal(cs.protos, msg.protos) is noisy, variant
