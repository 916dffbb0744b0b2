"""FedDRA (fedheads.alignment.algorithm*): rho = 0, mu = 0 is FedAvg, stage 1 from cached token states
equals stage 1 with live frozen encoders, sums + finalize equal the stacked server step, the
retrieval metrics by hand, and the run's schedule and presets (the test doubles of vl_doubles).

The cache-versus-live comparisons train with SGD: the store's token states equal the live ones
only up to float32 rounding (convolutions pick other kernels for other batch sizes), and Adam
turns such noise in near-zero gradient components into lr-sized steps; SGD keeps it at its size."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import vl_doubles

from embedcache.errors import UserError
from fedheads.alignment.algorithm import FDMessage, FedDRA, FedDRAConfig, info_nce, l_c, l_mi
from fedheads.alignment.driver import _seed, run_feddra
from fedheads.alignment.dro import DROConfig
from fedheads.alignment.evaluation import retrieval
from fedheads.alignment.model import DualEncoder, ModuleShape, is_module_key
from fedheads.alignment.pairs import cache_from_store, eval_batches, pair_clients, step_rows
from fedheads.alignment.runner import BASELINES, apply_baseline
from fedheads.finetuning.data import seeded

CPU = torch.device("cpu")
LAST = lambda r, n: r == n  # noqa: E731 - evaluate after the last round only (--eval-every 0)
SHAPE = ModuleShape(width=16, heads=2, mlp_ratio=2, out_dim=8)


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    return vl_doubles.make_paired(tmp_path_factory.mktemp("feddra"))


def _world(m, store=None):
    from embedcache.backbones import create_backbone
    from embedcache.sources import open_source

    img, text = create_backbone("tiny-staged"), create_backbone(vl_doubles.TEXT)
    clients = pair_clients(m, open_source(m.source), img.transform, text)
    if store is not None:
        cache_from_store(clients, m, store, "tiny-staged@stem", vl_doubles.TEXT_TOKENS)

    def make(seed: int = 0, **kw) -> DualEncoder:
        return DualEncoder(img.trainable(), "stem", text.trainable(), text.token_dim, shape=SHAPE, seed=seed, **kw)
    return clients, make


def _run(cfg, clients, make, **kw):
    net = make()
    return run_feddra(FedDRA(cfg), net, copy.deepcopy(net), clients, seed=0, device=CPU, progress=False, **kw)


def _state(run):
    return {**run.state.model.params, **run.state.model.buffers}


def _close(a, b, **tol):
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


def _plain_fedavg(cfg, clients, make, seed=0, weights=None):
    """FedAvg written out by hand: every client starts from the global model, AdamW on the
    two-way InfoNCE L_MI (test_info_nce_by_hand), then the global model moves by the mean client change (McMahan et al. 2017,
    equal weights as Alg. 1 lines 7/12), summed in client order; `weights` (one per client): the
    mean weighted by them instead, sum_i w_i (x_i - g) / sum_i w_i."""
    net = make()
    g = {k: v.clone() for k, v in net.state(2).items()}
    for r in range(1, cfg.rounds + 1):
        for st in cfg.plan()[r - 1]:
            local = []
            for c in clients:
                with seeded(_seed(seed, r - 1, c.index, st)):  # BERT dropout: the driver's seed per (round, client, stage)
                    net.load_state(g)
                    net.set_mode(st)
                    named = net.named_trained(st)
                    groups = [{"params": [p for k, p in named if is_module_key(k)], "lr": cfg.lr},
                              {"params": [p for k, p in named if not is_module_key(k)], "lr": cfg.encoder_lr}]
                    opt = torch.optim.AdamW([x for x in groups if x["params"]], weight_decay=cfg.weight_decay)
                    rows = step_rows(c.n_train, c.index, cfg.batch_size, cfg.steps, seed, r - 1, st)
                    for b in c.batches("train", rows, CPU, augment=(seed, 2 * (r - 1) + st) if st == 2 else None):
                        with torch.set_grad_enabled(st == 2):
                            img, txt = net.image_tokens(b.images), net.text_tokens(b.ids, b.mask)
                        zx, zy = net.align(img, None, txt, b.mask)
                        loss = l_mi(zx, zy, cfg)  # the same float operations: Adam would amplify any noise
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                    local.append({k: v.clone() for k, v in net.state(st).items()})
            for k in local[0]:
                if weights is None:
                    total = local[0][k] - g[k]
                    for x in local[1:]:
                        total = total + (x[k] - g[k])
                    g[k] = g[k] + total / float(len(local))
                else:
                    total = sum(w * (x[k].double() - g[k].double()) for w, x in zip(weights, local))
                    g[k] = (g[k].double() + total / float(sum(weights))).to(g[k].dtype)
    return g


def test_rho0_mu0_is_fedavg(paired):
    m, _ = paired
    clients, make = _world(m)
    cfg = FedDRAConfig(rounds=2, steps=2, batch_size=4, mu=0.0, dro=DROConfig(rho=0.0), lr=1e-2, encoder_lr=1e-2)
    run = _run(cfg, clients, make, stage1_inputs="live")
    want = _plain_fedavg(cfg, clients, make)
    got = _state(run)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)  # bitwise
    assert all(s == 1.0 for rec in run.rounds[1:] for s in rec.scale)  # s_i = N lambda_i exactly 1
    assert run.state.lam.tolist() == [1 / 3] * 3
    assert any(v != 0 for v in run.rounds[-1].v)  # v_i is still measured and recorded
    # the same test fails for FedDRA proper (the comparison has teeth)
    for other in (dataclasses.replace(cfg, mu=5.0), dataclasses.replace(cfg, dro=DROConfig(rho=1.0))):
        got = _state(_run(other, clients, make, stage1_inputs="live"))
        assert max(float((got[k] - want[k]).abs().max()) for k in want) > 1e-4


def test_fedavg_preset_is_the_papers_one_stage_fedavg(paired):
    """`fedavg` is plain one-stage averaging (FedDRA Sec. 5.1.3): no stage 1, R rounds of E steps on
    everything, equal to FedAvg by hand bit for bit; `fedavg-two-stage` is the old preset (rho = 0,
    mu = 0 with FedDRA's two-stage schedule), equal bit for bit to that configuration's run."""
    m, _ = paired
    clients, make = _world(m)
    base = FedDRAConfig(rounds=2, steps=2, batch_size=4, lr=1e-2, encoder_lr=1e-2)  # mu 5, rho 0.1: FedDRA's
    one = apply_baseline(base, "fedavg")
    assert one.plan() == [(2,)] * 2 and (one.mu, one.dro.rho, one.steps, one.rounds) == (0.0, 0.0, 2, 2)
    assert apply_baseline(FedDRAConfig(rounds=5, schedule="sequential"), "fedavg").plan() == [(2,)] * 5
    assert apply_baseline(base, "fedprox").plan() == [(2,)] * 2
    two = apply_baseline(base, "fedavg-two-stage")
    old = dataclasses.replace(base, mu=0.0, dro=dataclasses.replace(base.dro, rho=0.0))  # the old `fedavg` preset
    assert two == old and two.plan() == [(1, 2)] * 2
    run_one = _run(one, clients, make, stage1_inputs="live")
    assert [rec.stages for rec in run_one.rounds[1:]] == [[2], [2]]
    got, want = _state(run_one), _plain_fedavg(one, clients, make)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    got_two, got_old = (_state(_run(c, clients, make, stage1_inputs="live")) for c in (two, old))
    assert all(torch.equal(got_two[k], got_old[k]) for k in got_old)
    assert max(float((got_two[k] - got[k]).abs().max()) for k in got) > 1e-4  # the schedules differ


def test_sample_weighted_aggregation_by_hand(paired):
    """Alg. 1 averages with 1/N; aggregation "samples" weights client i by its n_i training pairs."""
    alg, alg_n = FedDRA(FedDRAConfig()), FedDRA(FedDRAConfig(aggregation="samples"))
    from fedheads.algorithms.pfl_common import GlobalModel
    from fedheads.alignment.algorithm import FDServerState

    ss = FDServerState(GlobalModel({"psi/w": torch.zeros(2)}, {}), torch.full((2,), 0.5, dtype=torch.float64))
    deltas, n = (torch.tensor([4.0, 0.0]), torch.tensor([8.0, 2.0])), (1.0, 3.0)

    def fin(a, w):
        sums = a.sums_init(ss)
        for i in range(2):
            sums = a.sums_add(sums, FDMessage({"psi/w": deltas[i][None]}, {}, torch.tensor([w[i]], dtype=torch.float64),
                                              torch.tensor([0.0], dtype=torch.float64), torch.tensor([i])))
        return a.server_finalize(ss, sums).model.params["psi/w"]
    assert fin(alg, (1.0, 1.0)).tolist() == [6.0, 1.0]  # (4 + 8) / 2, (0 + 2) / 2
    assert fin(alg_n, n).tolist() == [7.0, 1.5]  # (1 * 4 + 3 * 8) / 4, (1 * 0 + 3 * 2) / 4
    with pytest.raises(UserError, match="aggregation"):
        FedDRAConfig(aggregation="size")
    # through the driver: the clients' n_i reach the server (clients of different sizes)
    m, _ = paired
    clients, make = _world(m)
    cfg = apply_baseline(FedDRAConfig(rounds=1, steps=2, batch_size=4, lr=1e-2, encoder_lr=1e-2,
                                      aggregation="samples"), "fedavg")
    sizes = [float(c.n_train) for c in clients]
    want = _plain_fedavg(cfg, clients, make, weights=sizes)
    got = _state(_run(cfg, clients, make, stage1_inputs="live"))
    _close(got, want, rtol=1e-5, atol=1e-6)
    if len(set(sizes)) > 1:  # the weights matter on this data
        uni = _plain_fedavg(cfg, clients, make)
        assert max(float((got[k] - uni[k]).abs().max()) for k in got) > 1e-5


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_weight_decay_is_not_scaled_by_the_dro_step_scale(paired, monkeypatch, optimizer):
    """s_i = N lambda_i scales the gradient step only (Sec. 4.3's update has no decay): with a zero
    gradient, E steps shrink every trained weight by (1 - lr wd)^E at any s_i."""
    import fedheads.alignment.algorithm as fd

    monkeypatch.setattr(fd, "l_mi", lambda zx, zy, cfg: 0.0 * (zx.sum() + zy.sum()))  # gradient exactly 0
    m, _ = paired
    clients, make = _world(m)
    cfg = FedDRAConfig(steps=3, batch_size=4, mu=0.0, lr=1e-2, weight_decay=2.0, optimizer=optimizer)
    alg, net = FedDRA(cfg), make()
    ss = alg.init(net, 3)
    c = clients[0]
    out = {}
    for scale in (1.0, 2.0, 0.5):
        rows = step_rows(c.n_train, c.index, cfg.batch_size, cfg.steps, 0, 0, 1)
        msg = alg.client_update(1, ss.model, c.batches("train", rows, CPU), scale, c.index, net, None)
        out[scale] = msg.delta
    shrink = (1 - cfg.lr * cfg.weight_decay) ** cfg.steps - 1
    for k, d in out[1.0].items():
        torch.testing.assert_close(d[0], ss.model.params[k] * shrink, rtol=1e-5, atol=1e-7)
        for scale in (2.0, 0.5):
            torch.testing.assert_close(out[scale][k], d, rtol=1e-5, atol=1e-7)


def test_stage1_from_cache_equals_live_frozen_encoders(paired):
    m, store = paired
    cfg = FedDRAConfig(rounds=2, schedule="sequential", stage1_rounds=2, steps=3, batch_size=4, mu=5.0,
                       dro=DROConfig(rho=1.0), optimizer="sgd", lr=0.5)
    world = _world(m, store)
    # the store's token states are the live frozen encoders' outputs (up to float32 rounding)
    c = world[0][1]
    b = next(c.batches("train", [np.arange(c.n_train)], CPU))
    net = world[1]()
    with torch.no_grad():
        torch.testing.assert_close(c.train.base.img, net.image_tokens(b.images), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c.train.base.txt, net.text_tokens(b.ids, b.mask), rtol=1e-5, atol=1e-6)
    assert torch.equal(c.train.base.txt_mask, b.mask)
    cached = _run(cfg, *world)
    live = _run(cfg, *_world(m), stage1_inputs="live")
    reenc = _run(cfg, *_world(m), stage1_inputs="reencode")
    assert [r.reencoded for r in cached.rounds] == [0, 0, 0]  # the store's tokens: no encoder pass at all
    assert reenc.rounds[1].reencoded == sum(c.n_train for c in world[0]) and reenc.rounds[2].reencoded == 0
    start = net.state(2)
    moved = max(float((_state(cached)[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-2  # the tolerance below is far below what training changed
    for other in (live, reenc):
        _close(_state(cached), _state(other), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(cached.state.lam.numpy(), other.state.lam.numpy(), rtol=1e-5)
    assert not np.allclose(cached.state.lam.numpy(), 1 / 3)  # DRO moved lambda
    enc = [k for k in start if not is_module_key(k)]
    assert all(torch.equal(_state(cached)[k], start[k]) for k in enc)  # stage 1 never moves the encoders


def test_interleaved_reencodes_stale_caches_like_live(paired):
    m, store = paired
    # E * B = 20 >= n_i = 18: "auto" re-encodes a client once rather than encoding 20 rows live
    cfg = FedDRAConfig(rounds=2, steps=5, batch_size=4, mu=5.0, dro=DROConfig(rho=1.0), optimizer="sgd", lr=0.5,
                       encoder_lr=0.5)
    auto = _run(cfg, *_world(m, store))
    live = _run(cfg, *_world(m), stage1_inputs="live")
    assert auto.rounds[1].reencoded == 0 and auto.rounds[2].reencoded == sum(c.n_train for c in _world(m)[0])
    _close(_state(auto), _state(live), rtol=1e-4, atol=1e-6)
    assert auto.rounds[1].comm["stage1"]["down_values"] > auto.rounds[1].comm["stage2"]["down_values"]


def test_sums_then_finalize_equal_the_stacked_server_step(paired):
    m, _ = paired
    clients, make = _world(m)
    alg = FedDRA(FedDRAConfig())
    ss = alg.init(make(), 4)
    g = torch.Generator().manual_seed(0)
    keys = list(ss.model.params)[:3]
    msg = FDMessage({k: torch.randn(4, *ss.model.params[k].shape, generator=g) for k in keys}, {},
                    torch.ones(4, dtype=torch.float64), torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64),
                    torch.tensor([2, 0, 3, 1]))
    stacked = alg.server_aggregate(ss, msg)
    sums = alg.sums_init(ss)
    for i in range(4):
        sums = alg.sums_add(sums, FDMessage({k: v[i:i + 1] for k, v in msg.delta.items()}, {}, msg.weight[i:i + 1],
                                            msg.v[i:i + 1], msg.client[i:i + 1]))
    streamed = alg.server_finalize(ss, sums)
    for k in keys:  # Alg. 1 line 7: the unweighted mean
        torch.testing.assert_close(streamed.model.params[k], ss.model.params[k] + msg.delta[k].mean(0))
        torch.testing.assert_close(stacked.model.params[k], streamed.model.params[k])
    assert sums.v.tolist() == [1.0, 3.0, 0.5, 2.0]  # v scattered by client id
    untouched = [k for k in ss.model.params if k not in keys]
    assert all(torch.equal(streamed.model.params[k], ss.model.params[k]) for k in untouched)


def test_stages_train_what_the_paper_says(paired):
    m, _ = paired
    _, make = _world(m)
    net = make()
    assert all(is_module_key(k) for k in net.state(1))
    assert {k.split("/")[0] for k in net.state(2)} == {"psi", "phi", "image:stem", "text:embeddings", "text:layer.0",
                                                       "text:layer.1"}
    part = make(text_trainable="after:embeddings", image_trainable="frozen")
    assert {k.split("/")[0] for k in part.state(2)} == {"psi", "phi", "text:layer.0", "text:layer.1"}
    early = make(text_cut="layer.0")  # tokens after layer.0: layer.1 is never used, never trained
    assert {k.split("/")[0] for k in early.state(2)} == {"psi", "phi", "image:stem", "text:embeddings", "text:layer.0"}
    with pytest.raises(UserError, match="--text-cut pool"):
        make(text_cut="pool")
    with pytest.raises(UserError, match="image_trainable 'after:block'"):
        make(image_trainable="after:block")  # after the token cut: unused stages
    with pytest.raises(UserError, match="no cut 'pool'"):
        DualEncoder(make().image, "pool", make().text, 16)
    assert FedDRAConfig(rounds=4).plan() == [(1, 2)] * 4
    assert FedDRAConfig(rounds=5, schedule="sequential").plan() == [(1,)] * 3 + [(2,)] * 2
    assert FedDRAConfig(rounds=3, two_stage=False).plan() == [(2,)] * 3
    base = FedDRAConfig(mu=5.0, dro=DROConfig(rho=0.3), steps=7)
    assert set(BASELINES) == {"feddra", "fedavg", "fedavg-two-stage", "fedprox", "no-two-stage", "no-constraint",
                              "no-dro"}
    fa = apply_baseline(base, "fedavg")
    assert (fa.mu, fa.dro.rho, fa.steps, fa.prox_mu) == (0.0, 0.0, 7, 0.0)
    assert apply_baseline(base, "fedprox").prox_mu == 0.01
    assert apply_baseline(dataclasses.replace(base, prox_mu=0.1), "fedprox").prox_mu == 0.1
    assert apply_baseline(base, "no-two-stage").two_stage is False and apply_baseline(base, "no-dro").mu == 5.0
    with pytest.raises(UserError, match="schedule"):
        FedDRAConfig(schedule="weekly")


def test_batches_and_evaluation_batches():
    for n, b, e in ((10, 4, 7), (3, 8, 2), (64, 64, 3)):
        steps = step_rows(n, 1, b, e, 0, 0, 1)
        assert len(steps) == e and all(len(s) == min(b, n) and len(set(s.tolist())) == len(s) for s in steps)
        assert [s.tolist() for s in steps] == [s.tolist() for s in step_rows(n, 1, b, e, 0, 0, 1)]
        assert [s.tolist() for s in steps] != [s.tolist() for s in step_rows(n, 2, b, e, 0, 0, 1)] or n == 1
    for n in (5, 64, 100, 130):
        batches = eval_batches(n, 0, 0)
        counted = np.concatenate([rows[c] for rows, c in batches])
        assert sorted(counted.tolist()) == list(range(n))  # every query exactly once
        assert all(len(rows) == min(64, n) for rows, _ in batches)


def test_retrieval_by_hand():
    # 4 pairs; text 0 matches image 0 best, text 1 ranks image 1 second, texts 2 and 3 share a caption
    zx = torch.eye(4)
    zy = torch.tensor([[1.0, 0, 0, 0], [0.9, 0.5, 0, 0], [0, 0, 0.1, 1.0], [0, 0, 0, 1.0]])
    texts = ["a", "b", "c", "c"]
    labels = torch.tensor([0, 1, 1, 1])
    r = retrieval(zx, zy, texts, labels, [(np.arange(4), np.ones(4, dtype=bool))], ks=(1, 2))
    assert r["t2i_r1"] == pytest.approx(2 / 4)  # texts 0 and 3
    assert r["t2i_r2"] == pytest.approx(1.0)
    assert r["cap_t2i_r1"] == pytest.approx(3 / 4)  # text 2's top image (3) has its caption
    assert r["chance_r1"] == pytest.approx(1 / 4) and r["chance_r2"] == pytest.approx(2 / 4)
    assert r["class_r1"] == pytest.approx((1 + 3 * (1 / 3)) / 4)  # class 1 holds 3 images
    # image -> text: after normalisation every image's best text is its own (image 3: 1.0 vs 0.995)
    assert r["i2t_r1"] == pytest.approx(1.0) and r["cap_i2t_r1"] == pytest.approx(1.0)
    # only the counted queries of a batch are scored
    r2 = retrieval(zx, zy, texts, labels, [(np.arange(4), np.array([False, True, True, False]))], ks=(1,))
    assert r2["t2i_r1"] == 0.0 and r2["cap_t2i_r1"] == pytest.approx(0.5)


def test_info_nce_and_constraint_by_hand():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    b = torch.tensor([[3.0, 0.0], [1.0, 1.0]])
    # App. D Eq. 4: cos(a_i, b_j) / tau, -log softmax over j at j = i, mean over i
    cos = torch.tensor([[1.0, 2 ** -0.5], [0.0, 2 ** -0.5]]) / 0.1
    want = -0.5 * (torch.log_softmax(cos[0], 0)[0] + torch.log_softmax(cos[1], 0)[1])
    torch.testing.assert_close(info_nce(a, b, 0.1), want)
    cfg = FedDRAConfig(tau=0.1)
    torch.testing.assert_close(l_mi(a, b, cfg), 0.5 * (info_nce(a, b, 0.1) + info_nce(b, a, 0.1)))
    assert float(l_mi(a, b, dataclasses.replace(cfg, infonce="image-to-text"))) == float(info_nce(a, b, 0.1))
    # L_C on the normalised z: ||(1,0) - (0,1)||^2 = 2 and 0 for the text term
    zx, ax = torch.tensor([[5.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    assert float(l_c(zx, ax, ax, ax, cfg)) == pytest.approx(2.0)
    assert float(l_c(zx, zx * 2, ax, ax, dataclasses.replace(cfg, constraint_on="raw"))) == pytest.approx(34 + 109)
    assert float(l_c(zx, zx * 2, ax, ax, dataclasses.replace(cfg, constraint_on="raw", constraint="as-printed"))) == \
        pytest.approx(34 + 109 ** 0.5)


def test_stage1_from_cache_never_runs_an_encoder_or_reads_an_image(paired, monkeypatch):
    """The stage-1 path from the store: no encoder forward, no image read, and the anchor z* of
    L_C once per training row and round (not once per step); the same weights as the live run."""
    from fedheads.finetuning.data import ImageLoader

    m, store = paired
    # E * B = 20 > n_i = 18: every row of a client is in several steps, the anchor is computed once
    cfg = FedDRAConfig(rounds=2, schedule="sequential", stage1_rounds=2, steps=5, batch_size=4, mu=5.0,
                       dro=DROConfig(rho=1.0), optimizer="sgd", lr=0.5)
    live = _run(cfg, *_world(m), stage1_inputs="live")
    clients, make = _world(m, store)
    calls = {"image": 0, "text": 0, "read": 0, "anchor": 0}

    def counting(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(DualEncoder, "image_tokens", counting("image", DualEncoder.image_tokens))
    monkeypatch.setattr(DualEncoder, "text_tokens", counting("text", DualEncoder.text_tokens))
    monkeypatch.setattr(ImageLoader, "read", counting("read", ImageLoader.read))
    net = make()
    glob = copy.deepcopy(net)
    glob.align = counting("anchor", glob.align)
    cached = run_feddra(FedDRA(cfg), net, glob, clients, seed=0, device=CPU, progress=False)
    assert calls["image"] == calls["text"] == calls["read"] == 0
    per_pass = sum(-(-c.n_train // 64) for c in clients)  # one batch of <= 64 rows per client
    evals = (cfg.rounds + 1) * sum(-(-c.test.n // 64) for c in clients)
    assert calls["anchor"] == cfg.rounds * per_pass + evals  # not rounds * N * E = 30 anchor passes
    _close(_state(cached), _state(live), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(cached.state.lam.numpy(), live.state.lam.numpy(), rtol=1e-5)


def test_live_stage1_encodes_a_batch_once_for_model_and_anchor(paired, monkeypatch):
    """Live stage 1 with L_C: the frozen encoders run once per batch and the anchor reads those
    token states (its encoders hold the same weights); bit-identical to encoding twice. An anchor
    whose encoders differ is never given the model's tokens."""
    m, _ = paired
    cfg = FedDRAConfig(rounds=2, schedule="sequential", stage1_rounds=2, steps=3, batch_size=4, mu=5.0,
                       dro=DROConfig(rho=1.0), optimizer="sgd", lr=0.5)
    calls = {"image": 0}

    def counting(fn):
        def wrapped(*a, **kw):
            calls["image"] += 1
            return fn(*a, **kw)
        return wrapped
    monkeypatch.setattr(DualEncoder, "image_tokens", counting(DualEncoder.image_tokens))
    clients, make = _world(m)
    shared = _run(cfg, clients, make, stage1_inputs="live")
    n_shared = calls["image"]
    monkeypatch.setattr(FedDRA, "share_frozen_pass", False)
    calls["image"] = 0
    twice = _run(cfg, clients, make, stage1_inputs="live")
    steps = cfg.rounds * len(clients) * cfg.steps
    assert calls["image"] - n_shared == steps  # the second pass per step is gone, nothing else changed
    for k, v in _state(twice).items():
        assert torch.equal(v, _state(shared)[k]), k
    assert torch.equal(twice.state.lam, shared.state.lam)

    monkeypatch.setattr(FedDRA, "share_frozen_pass", True)
    alg, net = FedDRA(cfg), make()
    other = make()
    with torch.no_grad():
        next(other.image.parameters()).add_(0.1)
    assert alg.shares_encoders(net, copy.deepcopy(net), 1)
    assert not alg.shares_encoders(net, other, 1) and not alg.shares_encoders(net, copy.deepcopy(net), 2)


def test_resume_counts_the_down_link_as_an_uninterrupted_run(paired, tmp_path):
    """Killed after round 2 of stage 1 and resumed: round 3 (the first stage 2) sends the clients
    the modules only, as in the uninterrupted run; they already hold the pre-trained encoders."""
    from fedheads.alignment.driver import feddra_checkpoint

    m, _ = paired
    cfg = FedDRAConfig(rounds=3, schedule="sequential", stage1_rounds=2, steps=1, batch_size=4,
                       dro=DROConfig(rho=1.0), optimizer="sgd", lr=0.5)
    clients, make = _world(m)
    ref = _run(cfg, clients, make, stage1_inputs="live", evaluates=LAST)
    ck = feddra_checkpoint(tmp_path / "c.pt", {"test": 1})

    class Killed(Exception):
        pass

    def kill(rec):
        if rec.round == 2:
            raise Killed
    with pytest.raises(Killed):
        _run(cfg, clients, make, stage1_inputs="live", evaluates=LAST, checkpoint=ck, on_round=kill)
    got = _run(cfg, clients, make, stage1_inputs="live", evaluates=LAST, checkpoint=ck, resume=True)
    assert got.resumed_from == 2
    assert [r.comm for r in got.rounds] == [r.comm for r in ref.rounds]
    assert ref.rounds[3].comm["stage2"]["down_values"] < ref.rounds[1].comm["stage1"]["down_values"]
    for k, v in _state(ref).items():
        assert torch.equal(v, _state(got)[k]), k
    assert torch.equal(got.state.lam, ref.state.lam)
