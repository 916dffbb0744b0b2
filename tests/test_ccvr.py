"""CCVR (fedheads/algorithms/ccvr.py): the federated class Gaussians equal FL-bench's combination of
local means and covariances (CCVR Sec. 4), the calibration is FL-bench's SGD loop on the virtual
features, runs are a function of the seed, both engines agree, SecAgg+'s sums give the same head,
and on a label-skewed federation the calibrated head beats the FedAvg head it calibrates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fed_tiny import tiny_fed
from test_engine_equivalence import BUCKETS, _assert_engines_agree, bucketed_fed

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms.ccvr import (
    CCVR,
    CCVRConfig,
    CCVRMessage,
    class_gaussians,
    fit_linear,
    gaussian_factor,
    second_moments,
    virtual_features,
)
from fedheads.algorithms.fedncm import client_stats
from fedheads.core import run
from fedheads.core.federation import FedData, to_layout
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import tree_cat, tree_leaves
from fedheads.run.load import from_arrays


def fl_bench_mean_cov(features_means, features_covs, features_count, train_clients, num_classes):
    """KarhouTam/FL-bench src/server/ccvr.py CCVRServer.compute_classes_mean_cov, transcribed
    (lists per client of per-class means, covariances and counts; `self.` removed)."""
    labels_count = [sum(cnts) for cnts in zip(*features_count)]
    classes_mean = [None for _ in range(num_classes)]
    classes_cov = [None for _ in range(num_classes)]
    for c, (means, counts) in enumerate(zip(zip(*features_means), zip(*features_count))):
        if sum(counts) > 0:
            weights = torch.tensor(counts) / labels_count[c]
            means_ = torch.stack(means, dim=-1)
            classes_mean[c] = torch.sum(means_ * weights, dim=-1)
    for c in range(num_classes):
        if classes_mean[c] is not None and labels_count[c] > 1:
            for k in train_clients:
                if classes_cov[c] is None:
                    classes_cov[c] = torch.zeros_like(features_covs[k][c])
                classes_cov[c] += ((features_count[k][c] - 1) / (labels_count[c] - 1)) * features_covs[k][c] + (
                    features_count[k][c] / (labels_count[c] - 1)) * (
                    features_means[k][c].unsqueeze(1) @ features_means[k][c].unsqueeze(0))
            classes_cov[c] -= (labels_count[c] / (labels_count[c] - 1)) * (
                classes_mean[c].unsqueeze(1) @ classes_mean[c].unsqueeze(0))
    return classes_mean, classes_cov


def local_stats(data: FedData, correction: int):
    """FL-bench CCVRClient.get_classwise_feature_means_and_covs on each client (float64)."""
    means, covs, counts = [], [], []
    for i in range(data.num_clients):
        x = data.x_train[i][data.m_train[i]].double()
        y = data.y_train[i][data.m_train[i]]
        mi, ci, ni = [], [], []
        for c in range(data.num_classes):
            fea = x[y == c]
            if fea.shape[0] > 0:
                mi.append(fea.mean(dim=0))
                ci.append(fea.t().cov(correction=correction) if fea.shape[0] > correction
                          else torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64))
            else:
                mi.append(torch.zeros(x.shape[1], dtype=torch.float64))
                ci.append(torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64))
            ni.append(int(fea.shape[0]))
        means.append(mi)
        covs.append(ci)
        counts.append(ni)
    return means, covs, counts


def skewed_fed(M: int = 8, D: int = 5, C: int = 4, seed: int = 0) -> FedData:
    """Label skew: each client holds mostly one class, the test sets are balanced."""
    rs = np.random.default_rng(seed)
    centers = rs.normal(size=(C, D)) * 1.5
    clients = []
    for i in range(M):
        major = i % C
        p = np.full(C, 0.04 / (C - 1))
        p[major] = 0.96
        y = rs.choice(C, size=60, p=p)
        x = (centers[y] + rs.normal(size=(60, D))).astype("f4")
        yt = np.repeat(np.arange(C), 10)
        xt = (centers[yt] + rs.normal(size=(len(yt), D))).astype("f4")
        clients.append((x, y, xt, yt))
    return from_arrays(clients, C)


@pytest.mark.parametrize("covariance,correction", [("paper", 1), ("fl-bench", 0)])
def test_class_gaussians_equal_fl_bench_combination(covariance, correction):
    """Our sums-based mu_c, Sigma_c equal FL-bench's combination of local statistics: with
    unbiased local covariances (the paper's) for "paper", with FL-bench's own correction=0
    for "fl-bench"."""
    data = tiny_fed(M=5, D=4, C=3, seed=2)
    alg = CCVR(CCVRConfig(covariance=covariance))
    init = alg.init(data.spec(), seed=0)
    ctx = RoundCtx(0, 0, torch.arange(5), 5)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx)
    ss, _ = alg.server_aggregate(init.server_state, msg, ctx)
    mu, cov, usable = class_gaussians(ss.sums, ss.sq, ss.counts)
    means, covs, counts = local_stats(data, correction)
    ref_mu, ref_cov = fl_bench_mean_cov(means, covs, counts, range(5), 3)
    for c in range(3):
        assert bool(usable[c]) == (ref_cov[c] is not None)
        # FL-bench weights the local means with float32 weights (torch.tensor(counts) / N_c)
        torch.testing.assert_close(mu[c], ref_mu[c], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(cov[c], ref_cov[c], rtol=1e-5, atol=1e-5)
    if covariance == "paper":  # = the pooled features' unbiased covariance
        x, y = data.x_train[data.m_train].double(), data.y_train[data.m_train]
        torch.testing.assert_close(cov[0], x[y == 0].T.cov(), rtol=1e-10, atol=1e-10)


def test_second_moments_hand_computed_and_blocked():
    x = torch.tensor([[[1.0, 2.0], [3.0, 0.0], [9.0, 9.0]]])
    y = torch.tensor([[0, 0, 1]])
    m = torch.tensor([[True, True, False]])
    q = second_moments(x, y, m, 2)
    assert torch.equal(q[0, 0], torch.tensor([[10.0, 2.0], [2.0, 4.0]], dtype=torch.float64))
    assert torch.equal(q[0, 1], torch.zeros(2, 2, dtype=torch.float64))
    data = tiny_fed()
    a = second_moments(data.x_train, data.y_train, data.m_train, 3)
    b = second_moments(data.x_train, data.y_train, data.m_train, 3, block_elems=1)  # one row per block
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_virtual_features_have_the_class_moments_and_are_keyed():
    mu = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    a = torch.tensor([[1.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    cov = torch.stack([a @ a.T, torch.eye(3, dtype=torch.float64)])  # class 0's is singular
    f = gaussian_factor(cov)
    z, y = virtual_features(mu, f, torch.tensor([True, False]), 40000, seed=3, round_=1)
    assert z.dtype == torch.float32 and y.tolist() == [0] * 40000  # the unusable class draws nothing
    torch.testing.assert_close(z.double().mean(0), mu[0], atol=0.03, rtol=0)
    torch.testing.assert_close(z.double().T.cov(), cov[0], atol=0.03, rtol=0)
    assert torch.equal(z, virtual_features(mu, f, torch.tensor([True, False]), 40000, 3, 1)[0])
    assert not torch.equal(z, virtual_features(mu, f, torch.tensor([True, False]), 40000, 3, 2)[0])


def test_calibration_is_fl_bench_sgd_loop():
    """FL-bench calibrate_classifier: nn.Linear, CrossEntropyLoss, torch.optim.SGD(lr), one pass of
    mini-batches; fed the same rows in the same order, fit_linear gives the same head."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(70, 5, generator=g), torch.randint(0, 3, (70,), generator=g)
    perm = torch.randperm(70, generator=g)
    lin = torch.nn.Linear(5, 3)
    head = {"cls.weight": lin.weight.detach().T.clone(), "cls.bias": lin.bias.detach().clone()}
    got = fit_linear(head, x, y, optimizer="sgd", lr=0.05, epochs=1, batch_size=16, key=(0,),
                     order=lambda e, n: perm)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.05)
    for a in range(0, 70, 16):  # DataLoader(batch_size=16) over the shuffled rows
        idx = perm[a:a + 16]
        loss = criterion(lin(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.testing.assert_close(got["cls.weight"], lin.weight.detach().T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["cls.bias"], lin.bias.detach(), rtol=1e-6, atol=1e-6)


def test_calibrated_head_beats_fedavg_head_under_label_skew():
    data = skewed_fed()
    res = run(create_algorithm("ccvr", local_epochs=2), data, rounds=3, seed=0, progress=False)
    acc = res.history[-1].accuracy
    cal, fedavg = float(acc["main"].mean()), float(acc["fedavg"].mean())
    assert cal > 0.5 and cal > fedavg + 0.05, (cal, fedavg)  # chance is 0.25


def test_runs_are_a_function_of_the_seed():
    data = tiny_fed()
    a, b, c = (run(create_algorithm("ccvr"), data, rounds=2, seed=s, fraction=0.5, progress=False) for s in (4, 4, 5))
    for ta, tb in zip(tree_leaves(a.server_state), tree_leaves(b.server_state)):
        assert torch.equal(ta, tb)
    assert not torch.equal(a.server_state.calibrated["cls.weight"], c.server_state.calibrated["cls.weight"])


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_engines_agree(fraction):
    make = lambda: CCVR(CCVRConfig(batch_size=4, virtual_per_class=20))  # noqa: E731
    _assert_engines_agree(make, tiny_fed(), tiny_fed(), fraction)
    _assert_engines_agree(make, bucketed_fed(), tiny_fed(M=6), fraction)
    ordered = tiny_fed(M=6).by_size()[0]  # stored largest first, as `fedheads train` loads them
    _assert_engines_agree(make, to_layout(ordered, BUCKETS), ordered, fraction)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_engines_agree_calibrating_a_saved_head(fraction):
    """head=RUN_DIR: statistics-only messages, then empty ones; the saved head is stood in for."""
    def make():
        alg = CCVR(CCVRConfig(head="saved-run", virtual_per_class=20))
        g = torch.Generator().manual_seed(0)
        alg._saved = (torch.randn(6, 3, generator=g), torch.randn(3, generator=g))  # what the run would give
        return alg

    _assert_engines_agree(make, tiny_fed(), tiny_fed(), fraction, trains=False)
    _assert_engines_agree(make, bucketed_fed(), tiny_fed(M=6), fraction, trains=False)


def test_statistics_are_sent_once_and_collected_until_every_client_reported():
    data = tiny_fed(M=6)
    full = run(create_algorithm("ccvr"), data, rounds=3, seed=1, progress=False)
    up = [h.comm.up_values for h in full.history]
    assert up[0] > up[1] == up[2]  # statistics in round 0 only
    part = run(create_algorithm("ccvr"), data, rounds=6, seed=1, fraction=0.5, progress=False)
    ss = part.server_state
    seen = sorted({i for h in part.history for i in h.participants})
    assert ss.reported.nonzero().view(-1).tolist() == seen
    sums, counts = client_stats(data.x_train, data.y_train, data.m_train, 3)
    torch.testing.assert_close(ss.sums, sums[seen].sum(0), rtol=1e-12, atol=1e-12)  # each client once
    assert torch.equal(ss.counts, counts[seen].sum(0))


def test_secure_form_gives_the_plain_head():
    """SecAgg+ adds each client's secure fields; the server step on the totals equals the plain
    server step on the stacked messages (the FedAvg delta to float32 rounding)."""
    data = tiny_fed()
    alg = CCVR(CCVRConfig(batch_size=4, virtual_per_class=30))
    init = alg.init(data.spec(), seed=2)
    cs, ss, bc = init.client_state, init.server_state, init.broadcast
    for r in range(2):
        ctx = RoundCtx(r, 2, torch.arange(4), 4)
        cs_new, msg = alg.client_update(cs, bc, data, ctx)
        assert isinstance(msg, CCVRMessage) == (r == 0)
        plain_ss, plain_bc = alg.server_aggregate(ss, msg, ctx)
        form = alg.secure_form(msg)
        rows = [_row(msg, i) for i in range(4)]
        parts = [form.sums(m) for m in rows]
        tot = {k: sum(p[k] for p in parts) for k in parts[0]}
        clear = [form.clear(m) for m in rows]
        sec_ss, sec_bc = form.aggregate(ss, None if clear[0] is None else tree_cat(clear), tot, ctx)
        for a, b in zip(tree_leaves(plain_ss), tree_leaves(sec_ss)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert plain_bc.collect == sec_bc.collect == False  # noqa: E712  (everyone reported in round 0)
        cs, ss, bc = cs_new, plain_ss, plain_bc


def _row(msg, i):
    from fedheads.core.tree import tree_index

    return tree_index(msg, torch.tensor([i]))


def test_predict_main_is_the_calibrated_head_and_options_are_checked():
    data = tiny_fed()
    res = run(create_algorithm("ccvr"), data, rounds=1, seed=0, progress=False)
    alg = create_algorithm("ccvr")
    out = alg.predict(res.client_state, res.server_state, data.x_test, data.m_test)
    w, b = res.server_state.calibrated["cls.weight"], res.server_state.calibrated["cls.bias"]
    torch.testing.assert_close(out["main"], data.x_test @ w + b)
    assert alg.global_rule == "main" and set(out) == {"main", "fedavg", "local_model"}
    for bad in ({"virtual_per_class": 0}, {"covariance": "biased"}, {"calib_lr": -1.0}):
        with pytest.raises(UserError):
            create_algorithm("ccvr", **bad)


def test_cli_train_then_predict_equals_the_evaluation(tmp_path):
    """`fedheads train --algorithm ccvr` then `fedheads predict`: the saved calibrated head
    predicts what the trainer evaluated."""
    from test_fedheads_cli import train_then_predict

    train_then_predict(tmp_path, "--algorithm", "ccvr", "--rounds", "2", "--seeds", "1", "--set", "virtual_per_class=50")


def test_flower_secagg_gives_the_engines_head(tmp_path):
    """Through Flower's SecAgg+ (in-process simulation) the statistics and FedAvg deltas arrive as
    quantised sums: the FedAvg and calibrated heads equal the loop engine's to that rounding."""
    pytest.importorskip("flwr")
    from flower_helpers import write_store

    from fedheads.flower.server import FlowerRunConfig
    from fedheads.flower.sim import simulate_store
    from fedheads.run.load import load_fed_data
    from fedheads.run.train import TrainOptions, build_algorithm

    store = write_store(tmp_path)
    out = simulate_store(FlowerRunConfig(algorithm="ccvr", backbones="synth", rounds=2, timeout=120, secagg=True,
                                         seed=3), store)
    alg, _, _ = build_algorithm("ccvr", TrainOptions(), strict=True)
    ref = run(alg, load_fed_data(store, ["synth"], "cpu"), 2, seed=3, engine="loop", progress=False).server_state
    got = out["server_state"]
    assert torch.equal(got.counts, ref.counts) and bool(got.reported.all())
    torch.testing.assert_close(got.sums, ref.sums, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got.sums, ref.sums)  # quantised secure sums, not the plain message
    for k in ref.calibrated:
        torch.testing.assert_close(got.lp.params[k], ref.lp.params[k], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.calibrated[k], ref.calibrated[k], rtol=1e-4, atol=1e-4)


def test_head_of_a_saved_run_is_calibrated(tmp_path):
    """head=RUN_DIR: the saved LP run's head is read off its predict, left as it is ("fedavg"
    scores what the LP run scored) and calibrated; a head that is not x W + b is refused."""
    import json

    from test_fedheads_cli import CLIENTS, _invoke, _write_store

    store = _write_store(tmp_path)
    base = ["--store", str(store), "--backbones", "synth", "--seeds", "1", "--quiet"]
    assert _invoke(["train", *base, "--algorithm", "lp", "--rounds", "3", "--out", str(tmp_path / "lp")]).exit_code == 0
    r = _invoke(["train", *base, "--algorithm", "ccvr", "--rounds", "2", "--out", str(tmp_path / "cal"),
                 "--set", f"head={tmp_path / 'lp'}"])
    assert r.exit_code == 0, r.output
    lp = json.loads((tmp_path / "lp" / "results.json").read_text())
    cal = json.loads((tmp_path / "cal" / "results.json").read_text())
    last = {(row["client"], row["rule"]): row["accuracy"] for row in _rows(tmp_path / "cal") if row["round"] == "2"}
    for c in CLIENTS:
        assert float(last[(c, "fedavg")]) == pytest.approx(lp["per_client"][c]["mean"], abs=1e-3)  # csv: 4 decimals
    assert cal["trainable_params_per_client"] == 0
    from fedheads.run.saved import open_run

    saved = open_run(tmp_path / "lp").server_state.params
    ss = open_run(tmp_path / "cal").server_state
    for k in saved:  # read off predict: float32 rounding of x W + b
        torch.testing.assert_close(ss.lp.params[k], saved[k], rtol=1e-6, atol=1e-6)
    assert not torch.equal(ss.calibrated["cls.weight"], saved["cls.weight"])
    assert _invoke(["train", *base, "--algorithm", "fedncm", "--rounds", "1", "--out", str(tmp_path / "ncm")]).exit_code == 0
    r = _invoke(["train", *base, "--algorithm", "ccvr", "--rounds", "1", "--out", str(tmp_path / "bad"),
                 "--set", f"head={tmp_path / 'ncm'}"])
    assert r.exit_code != 0 and "not a linear head" in r.output and r.output.count("\n") == 1, r.output


def _rows(run_dir):
    import csv

    (path,) = run_dir.glob("metrics*.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def test_settings_show_the_docs_and_sources_declared_with_setting():
    """`fedheads algorithms ccvr|fedpft` list each key with the doc and source its
    fedheads.core.config.setting declares (the fields carry no comments)."""
    from fedheads.run.settings import settings_of

    rows = {r.key: r for r in settings_of("ccvr")[0]}
    assert rows["virtual_per_class"].doc.startswith("virtual features M_c") and "FL-bench" in rows["virtual_per_class"].source
    assert "FedAvg rounds" in rows["lr"].doc and rows["lr"].source == "FedNCM App. B (lp)"  # the nested optimiser's
    pft = {r.key: r for r in settings_of("fedpft")[0]}
    assert pft["covariance"].doc.startswith("mixture covariance type") and pft["covariance"].source == "baseline cov-type"


@pytest.mark.parametrize("saved", [False, True])
def test_the_summed_path_is_the_stacked_one(saved):
    """message_budget=1: the vectorised engine adds the clients' n-weighted deltas and pools their rows
    for the class statistics (no per-client [C, D, D] moments); the run is the stacked one to float
    rounding, its bytes counted per client as the stacked messages'."""
    def make():
        alg = CCVR(CCVRConfig(batch_size=4, virtual_per_class=20, head="saved-run" if saved else None))
        if saved:
            g = torch.Generator().manual_seed(0)
            alg._saved = (torch.randn(6, 3, generator=g), torch.randn(3, generator=g))
        return alg

    for fraction in (1.0, 0.5):
        a = run(make(), tiny_fed(), rounds=3, seed=3, fraction=fraction, progress=False)
        b = run(make(), tiny_fed(), rounds=3, seed=3, fraction=fraction, progress=False, message_budget=1)
        assert [h.comm for h in a.history] == [h.comm for h in b.history]
        for ta, tb in zip(tree_leaves(a.server_state), tree_leaves(b.server_state)):
            torch.testing.assert_close(ta, tb, atol=5e-5, rtol=1e-3)
        assert bool(b.server_state.reported.all()) == bool(a.server_state.reported.all())
