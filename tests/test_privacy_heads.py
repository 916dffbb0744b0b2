"""Differential privacy of CCVR (calibrating a saved head) and Fed3R's ridge penalty under DP
(fedheads.privacy): vanishing noise gives the plain heads, the refusals are one line, the noisy
Gram is symmetric, lambda from the noise level keeps the solve definite, and results.json records
the mechanism and the penalty used."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from fed_tiny import tiny_fed
from store_doubles import assert_one_line
from test_fedheads_cli import _write_store

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.algorithms.ccvr import CCVR, CCVRConfig, class_gaussians, gaussian_factor, saved_linear_head
from fedheads.algorithms.fed3r import Fed3R
from fedheads.algorithms.fedncm import FedNCM
from fedheads.cli import main
from fedheads.core.engine import run
from fedheads.core.federation import FedData
from fedheads.privacy import Mechanism, Private
from fedheads.run.load import from_arrays
from fedheads.run.saved import open_run


def _saved_ccvr(**kw) -> CCVR:
    """CCVR calibrating a saved head, the head stood in for (what the run would give)."""
    alg = CCVR(CCVRConfig(head="saved-run", virtual_per_class=40, **kw))
    g = torch.Generator().manual_seed(0)
    alg._saved = (torch.randn(6, 3, generator=g), torch.randn(3, generator=g))
    return alg


# ---------------------------------------------------------------------- CCVR
def test_ccvr_dp_is_refused_in_one_line_where_it_does_not_hold(tmp_path):
    with pytest.raises(UserError, match="dp: ccvr trains its FedAvg-LP head here, whose SGD deltas are not clipped"):
        Private(create_algorithm("ccvr"), Mechanism(noise_multiplier=1.0))
    with pytest.raises(UserError, match="covariance='fl-bench' .* not a sum over the client's examples"):
        Private(create_algorithm("ccvr", head="somewhere", covariance="fl-bench"), Mechanism(noise_multiplier=1.0))
    store = _write_store(tmp_path)
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "ccvr",
                                    "--rounds", "1", "--seeds", "0", "--device", "cpu", "--quiet",
                                    "--dp-epsilon", "1", "--out", str(tmp_path / "r")])
    assert_one_line(res, 2, "ccvr trains its FedAvg-LP head", "--set head=RUN_DIR")


def test_ccvr_sensitivities_are_one_examples():
    s = _saved_ccvr().dp_sensitivity(1.5)
    assert s == {"sums": 1.5, "sq": 2.25, "counts": 1.0}
    x = torch.randn(7)
    x = x * (1.5 / x.norm())  # an example on the clipping sphere moves q_c by x x^T
    assert float(torch.outer(x, x).norm()) == pytest.approx(s["sq"], rel=1e-6)


@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_ccvr_under_vanishing_noise_calibrates_as_the_plain_run(mode, fraction):
    """Rounds after the statistics are in send nothing (Empty): they release nothing and the
    calibrated head stays; a client's statistics are one release."""
    fed = tiny_fed(M=6)
    rounds = 4 if fraction < 1 else 2
    plain = run(_saved_ccvr(), fed, rounds, seed=3, fraction=fraction, progress=False)
    big = float(fed.x_train.norm(dim=-1).max()) * 2  # no feature is clipped
    alg = Private(_saved_ccvr(), Mechanism(clip=big, noise_multiplier=1e-12, mode=mode, noise_seed=0))
    res = run(alg, fed, rounds, seed=3, fraction=fraction, progress=False)
    ps, ss = plain.server_state, res.server_state
    assert torch.equal(ss.counts, ps.counts) and torch.equal(ss.usable, ps.usable)
    torch.testing.assert_close(ss.sums, ps.sums, rtol=0, atol=1e-8)
    torch.testing.assert_close(ss.sq, ps.sq, rtol=0, atol=1e-8)
    for k in ps.calibrated:
        torch.testing.assert_close(ss.calibrated[k], ps.calibrated[k], rtol=1e-5, atol=1e-5)
    assert torch.equal(res.final_accuracy(), plain.final_accuracy())
    assert alg.releases(res.client_state) == 1
    assert alg.report([1])["sensitivity"] == {"sums": big, "sq": big * big, "counts": 1.0}


def _fed_without(absent: int, M: int = 6, D: int = 6, C: int = 3) -> FedData:
    """A federation in which no client holds class `absent` (in training or test)."""
    rs = np.random.default_rng(1)
    centers = rs.normal(size=(C, D)) * 2
    held = [c for c in range(C) if c != absent]
    clients = []
    for i in range(M):
        y, yt = rs.choice(held, size=8 + 3 * i), rs.choice(held, size=6)
        clients.append(((centers[y] + rs.normal(size=(len(y), D))).astype("f4"), y,
                        (centers[yt] + rs.normal(size=(6, D))).astype("f4"), yt))
    return from_arrays(clients, C)


@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize("fraction", [1.0, 1 / 3])
def test_ccvr_class_no_client_holds_stays_unusable_over_collecting_rounds(mode, fraction):
    """Presence is decided on the running total of the noisy counts, not clamped to >= 1 per round:
    over several collecting rounds (partial participation) a class no client holds keeps a count
    of (here vanishing) noise and gets no virtual features, as with one collecting round."""
    fed = _fed_without(absent=2)
    rounds = 1 if fraction == 1 else 10
    if fraction < 1:  # the statistics take several collecting rounds to arrive
        assert not bool(run(_saved_ccvr(), fed, 1, seed=0, fraction=fraction, progress=False).server_state.reported.all())
    plain = run(_saved_ccvr(), fed, rounds, seed=0, fraction=fraction, progress=False).server_state
    big = float(fed.x_train.norm(dim=-1).max()) * 2  # no feature is clipped
    alg = Private(_saved_ccvr(), Mechanism(clip=big, noise_multiplier=1e-9, mode=mode, noise_seed=0))
    ss = run(alg, fed, rounds, seed=0, fraction=fraction, progress=False).server_state
    assert bool(ss.reported.all()) and ss.counts.tolist() == plain.counts.tolist()
    assert int(ss.counts[2]) == 0 and ss.usable.tolist() == [True, True, False]
    for k in plain.calibrated:  # no virtual features of noise for class 2: the plain calibration
        torch.testing.assert_close(ss.calibrated[k], plain.calibrated[k], rtol=1e-5, atol=1e-5)


def test_ccvr_declares_its_noisy_counts_unclamped():
    """CCVR's counts stay an integer field of the secure form (SecAgg+ rounds the sums back, before
    the server's noise in central mode); it declares that the private wrapper must not clamp their
    noisy totals per round, where FedNCM keeps the clamp. The declaration is the class's, so one
    object runs private and plain alike."""
    assert _saved_ccvr().secure_form().integer == ("counts",)
    assert CCVR.clamp_noisy_counts is False and FedNCM.clamp_noisy_counts is True
    alg = Private(_saved_ccvr(), Mechanism(clip=1.0, noise_multiplier=1.0, noise_seed=0))
    alg.init(tiny_fed(M=2).spec(), 0)
    assert alg.inner.secure_form().integer == ("counts",) and alg.secure_form().integer == ("counts",)


def test_ccvr_noisy_covariance_is_sampled_from_its_psd_part():
    """Strong noise: counts unclamped (classes with N_c < 2 get no virtual features), the noisy
    Sigma_c indefinite, its factor that of Sigma_c with negative eigenvalues set to 0."""
    fed = tiny_fed(M=6)
    alg = Private(_saved_ccvr(), Mechanism(clip=1.0, noise_multiplier=5.0, noise_seed=1))
    ss = run(alg, fed, 1, seed=0, progress=False).server_state
    assert torch.equal(ss.usable, ss.counts >= 2)
    _, cov, usable = class_gaussians(ss.sums, ss.sq, ss.counts)
    lam, vec = torch.linalg.eigh(cov[usable])
    assert bool((lam.min(-1).values < 0).any())  # the noise made some Sigma_c indefinite
    psd = vec @ torch.diag_embed(lam.clamp(min=0)) @ vec.transpose(1, 2)
    f = gaussian_factor(cov[usable])
    torch.testing.assert_close(f @ f.transpose(1, 2), psd, rtol=1e-9, atol=1e-9)
    assert bool(torch.isfinite(ss.calibrated["cls.weight"]).all())


def test_ccvr_calibrating_a_dp_fed3r_head_records_the_mechanism(tmp_path):
    store = _write_store(tmp_path)
    base = ["train", "--store", str(store), "--backbones", "synth", "--seeds", "0", "--device", "cpu", "--quiet"]
    r = CliRunner().invoke(main, [*base, "--algorithm", "fed3r", "--rounds", "1", "--dp-epsilon", "4",
                                  "--dp-clip", "2", "--set", "lam_noise_scale=2", "--out", str(tmp_path / "f3")])
    assert r.exit_code == 0, r.output
    out = tmp_path / "cal"
    r = CliRunner().invoke(main, [*base, "--algorithm", "ccvr", "--rounds", "2", "--dp-epsilon", "2",
                                  "--dp-clip", "2", "--set", f"head={tmp_path / 'f3'}", "--out", str(out)])
    assert r.exit_code == 0, r.output
    p = json.loads((out / "results.json").read_text())["privacy"]
    assert p["sensitivity"] == {"sums": 2.0, "sq": 4.0, "counts": 1.0}
    assert p["releases_per_example"] == 1 and p["epsilon"] <= 2.0
    head = json.loads((tmp_path / "f3" / "results.json").read_text())["privacy"]
    got = p["post_processing"]["calibrated_head_privacy"]  # the saved head's own release, beside this run's
    assert got["epsilon"] == head["epsilon"] and got["mode"] == head["mode"]
    z = p["noise_multiplier"]  # equal split over three fields: sigma_f = z * Delta_f * sqrt(3)
    assert p["noise_std"]["sq"] == pytest.approx(z * 4.0 * math.sqrt(3))
    pred = CliRunner().invoke(main, ["predict", "--run", str(out), "--store", str(store), "--out",
                                     str(tmp_path / "p.csv")])
    assert pred.exit_code == 0, pred.output


def test_ccvr_calibrates_a_dp_fed3r_head_that_lost_a_class_to_noise(tmp_path):
    """Strong noise: the saved Fed3R head's noisy count of class 2 is below 1, so Fed3R never
    predicts it (-inf). CCVR reads that class as a zero column and bias (as `linear_head` hands an
    absent class to fine-tuning) instead of refusing the head as not linear."""
    store = _write_store(tmp_path)
    base = ["train", "--store", str(store), "--backbones", "synth", "--seeds", "0", "--device", "cpu", "--quiet"]
    r = CliRunner().invoke(main, [*base, "--algorithm", "fed3r", "--rounds", "1", "--dp-noise-multiplier", "30",
                                  "--dp-noise-seed", "4", "--out", str(tmp_path / "f3")])
    assert r.exit_code == 0, r.output
    assert open_run(str(tmp_path / "f3"), 0).server_state.present.tolist() == [True, True, False, True]
    w, b = saved_linear_head(open_run(str(tmp_path / "f3"), 0), "head=f3", w_dim := 12, 4)
    assert w.shape == (w_dim, 4) and not bool(w[:, 2].any()) and float(b[2]) == 0.0
    assert bool(w[:, [0, 1, 3]].any(0).all())
    r = CliRunner().invoke(main, [*base, "--algorithm", "ccvr", "--rounds", "1", "--set", f"head={tmp_path / 'f3'}",
                                  "--out", str(tmp_path / "cal")])
    assert r.exit_code == 0, r.output
    assert math.isfinite(json.loads((tmp_path / "cal" / "results.json").read_text())["accuracy"]["mean"])


def test_fed3r_says_when_noise_left_no_class():
    """Every noisy count below 1: one line that says so, not "no statistics yet"."""
    fed = tiny_fed(M=2)
    alg = Private(create_algorithm("fed3r"), Mechanism(noise_multiplier=1e4, noise_seed=1))
    with pytest.raises(UserError, match="no statistics yet"):
        alg.predict(alg.init(fed.spec(), 0).client_state, alg.init(fed.spec(), 0).server_state, fed.x_test, fed.m_test)
    for seed in range(20):  # the run's own evaluation meets the head of no class
        alg = Private(create_algorithm("fed3r"), Mechanism(noise_multiplier=1e4, noise_seed=seed))
        try:
            run(alg, fed, 1, seed=0, progress=False)
        except UserError as e:
            assert "no class has a count >= 1" in str(e)
            return
    pytest.fail("no noise key left every class below a count of 1")


# ---------------------------------------------------------------------- Fed3R
def _private_fed3r(scale: float, seed: int, mode: str = "central") -> Private:
    return Private(create_algorithm("fed3r", lam_noise_scale=scale),
                   Mechanism(clip=1.0, noise_multiplier=1.0, mode=mode, noise_seed=seed))


@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize("fraction", [1.0, 1 / 3])
def test_fed3r_class_no_client_holds_stays_absent_under_dp(mode, fraction):
    """Fed3R's presence is decided on the running total of the noisy counts, not on counts clamped
    to >= 1 per round: a class no client holds keeps a count of (here vanishing) noise, is absent
    and never predicted, and the head is the plain one, over one or several collecting rounds."""
    fed = _fed_without(absent=2)
    rounds = 1 if fraction == 1 else 10
    plain = run(create_algorithm("fed3r"), fed, rounds, seed=0, fraction=fraction, progress=False)
    big = float(fed.x_train.norm(dim=-1).max()) * 2  # no feature is clipped
    alg = Private(create_algorithm("fed3r"), Mechanism(clip=big, noise_multiplier=1e-9, mode=mode, noise_seed=0))
    res = run(alg, fed, rounds, seed=0, fraction=fraction, progress=False)
    ss, ps = res.server_state, plain.server_state
    assert bool(res.client_state.inner.sent.all())  # every client's statistics arrived
    assert ss.counts.tolist() == ps.counts.tolist() and int(ss.counts[2]) == 0
    assert ss.present.tolist() == [True, True, False]
    torch.testing.assert_close(ss.weight, ps.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ss.bias, ps.bias, rtol=1e-5, atol=1e-6)
    assert Fed3R.clamp_noisy_counts is False
    scores = alg.predict(res.client_state, ss, fed.x_test, fed.m_test)["main"]
    assert bool(torch.isinf(scores[..., 2]).all())
    assert torch.equal(res.final_accuracy(), plain.final_accuracy())


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_fed3r_noisy_gram_is_symmetric(mode):
    fed = tiny_fed(D=12)
    ss = run(_private_fed3r(0.0, 0, mode), fed, 1, progress=False).server_state
    assert torch.equal(ss.gram, ss.gram.T)


def test_fed3r_lambda_from_the_noise_keeps_the_solve_definite():
    fed = tiny_fed(D=30)
    Dp = 31  # the bias column
    for seed in range(3):
        fixed = _private_fed3r(0.0, seed)
        ss = run(fixed, fed, 1, progress=False).server_state
        eye = torch.eye(Dp, dtype=torch.float64)
        assert float(torch.linalg.eigvalsh(ss.gram + 0.01 * eye).min()) < 0 and bool(ss.pinv)  # lam 0.01: indefinite
        auto = _private_fed3r(2.0, seed)
        ss = run(auto, fed, 1, progress=False).server_state
        lam = 0.01 + 2.0 * auto.noise_std["gram"] * math.sqrt(Dp)
        assert auto.inner.lam(Dp, 1, auto.noise_std["gram"]) == pytest.approx(lam)
        assert float(torch.linalg.eigvalsh(ss.gram + lam * eye).min()) > 0 and not bool(ss.pinv)
        post = auto.report([1])["post_processing"]
        assert post["fed3r_lam"] == pytest.approx(lam) and post["gram_dim"] == Dp


def test_fed3r_lam_noise_scale_changes_nothing_without_dp():
    fed = tiny_fed()
    a = run(create_algorithm("fed3r"), fed, 1, progress=False).server_state
    b = run(create_algorithm("fed3r", lam_noise_scale=5.0), fed, 1, progress=False).server_state
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    with pytest.raises(UserError, match="lam_noise_scale=-1.0"):
        create_algorithm("fed3r", lam_noise_scale=-1.0)


def test_fed3r_cli_records_the_lambda_used(tmp_path):
    store = _write_store(tmp_path)
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fed3r",
                                  "--rounds", "1", "--seeds", "0", "--device", "cpu", "--quiet",
                                  "--dp-noise-multiplier", "1", "--set", "lam_noise_scale=3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    p = json.loads((out / "results.json").read_text())["privacy"]
    post, sigma = p["post_processing"], p["noise_std"]["gram"]
    assert post["gram_noise_std"] == sigma and post["lam_noise_scale"] == 3.0
    assert post["fed3r_lam"] == pytest.approx(0.01 + 3.0 * sigma * math.sqrt(post["gram_dim"]))


# ---------------------------------------------------------------------- FedPFT, local DP
def _fedpft(**kw):
    return create_algorithm("fedpft", **{"components": 1, "covariance": "full", "server_epochs": 2, **kw})


@pytest.mark.parametrize("covariance", ["full", "diag", "spherical", "tied"])
def test_fedpft_local_dp_under_vanishing_noise_sends_the_em_gaussians(covariance):
    """One component: the Gaussians fitted to the noisy statistics are EM's (scikit-learn) when
    the noise vanishes, so the server trains the same head."""
    fed = tiny_fed(M=5)
    plain = run(_fedpft(covariance=covariance), fed, 1, seed=1, progress=False)
    big = float(fed.x_train.norm(dim=-1).max()) * 2  # no feature is clipped
    alg = Private(_fedpft(covariance=covariance), Mechanism(clip=big, noise_multiplier=1e-12, mode="local",
                                                            noise_seed=0))
    res = run(alg, fed, 1, seed=1, progress=False)
    ps, ss = plain.server_state, res.server_state
    assert torch.equal(ss.counts, ps.counts) and torch.equal(ss.owner, ps.owner)
    for k in ("weights", "means", "covariances"):
        torch.testing.assert_close(getattr(ss, k), getattr(ps, k), rtol=1e-4, atol=1e-5)
    for k in ps.head:
        torch.testing.assert_close(ss.head[k], ps.head[k], rtol=1e-3, atol=1e-4)
    assert alg.releases(res.client_state) == 1
    rep = alg.report([1])
    assert rep["mode"] == "local" and rep["sensitivity"] == {"sums": big, "sq": big * big, "counts": 1.0}


def test_fedpft_local_noise_is_each_clients_own_with_the_mechanisms_std():
    """The statistics each client fits its Gaussians to are its exact ones plus N(0, sigma_f^2)
    per entry (read by a spy on the message builder); clients already sent add none."""
    import numpy as np

    from fedheads.core.protocol import RoundCtx
    from fedheads.privacy import bounded

    fed = tiny_fed(M=4, D=4)
    alg = Private(_fedpft(), Mechanism(clip=1.0, noise_multiplier=0.8, mode="local", noise_seed=3))
    init = alg.init(fed.spec(), 0)
    real = alg.inner.local_form()
    exact = real.stats(init.client_state.inner, init.broadcast, bounded(fed, 1.0, "clip"), None)[1]
    seen = []
    from fedheads.core.protocol import LocalForm

    alg.inner.local_form = lambda: LocalForm(real.stats, lambda noisy, rel, d, c: seen.append(noisy) or
                                             real.message(noisy, rel, d, c))
    for r in range(40):
        ctx = RoundCtx(r, 0, torch.arange(fed.num_clients), fed.num_clients)
        alg.client_update(init.client_state, init.broadcast, fed, ctx)
    for k in exact:
        z = np.concatenate([((s[k] - exact[k]) / alg.noise_std[k]).reshape(-1).numpy() for s in seen])
        assert abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / z.size) and abs(z.mean()) < 5 / math.sqrt(z.size), k
    sent = alg.client_update(init.client_state, init.broadcast, fed, ctx)[0]
    seen.clear()
    _, msg = alg.client_update(sent, init.broadcast, fed, ctx)
    assert int(msg.counts.sum()) == 0 and all(float(v.abs().sum()) == 0 for v in seen[0].values())
    assert sent.releases.tolist() == [1] * 4


def test_fedpft_and_local_mode_refuse_what_they_cannot_do(tmp_path):
    with pytest.raises(UserError, match="fedpft sends each client's Gaussian mixtures.*under DP use --dp-mode local"):
        Private(_fedpft(), Mechanism(noise_multiplier=1.0))
    with pytest.raises(UserError, match="dp: fedpft with components=2"):
        Private(_fedpft(components=2), Mechanism(noise_multiplier=1.0, mode="local"))
    with pytest.raises(UserError, match="dp: fedncm has no local form"):
        Private(create_algorithm("fedncm"), Mechanism(noise_multiplier=1.0, mode="local"))
    store = _write_store(tmp_path)
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpft",
                                    "--rounds", "1", "--seeds", "0", "--device", "cpu", "--quiet",
                                    "--dp-epsilon", "1", "--out", str(tmp_path / "r")])
    assert_one_line(res, 2, "--dp-mode local")


def test_fedpft_local_dp_cli_run_records_the_mechanism(tmp_path):
    store = _write_store(tmp_path)
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpft",
                                  "--rounds", "1", "--seeds", "0", "--device", "cpu", "--quiet", "--dp-mode", "local",
                                  "--dp-epsilon", "4", "--set", "covariance=full", "--set", "server_epochs=2",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    p = json.loads((out / "results.json").read_text())["privacy"]
    assert p["mode"] == "local" and p["releases_per_example"] == 1 and p["epsilon"] <= 4.0
    assert "each client's own" in p["noise_std_per_client"]
    pred = CliRunner().invoke(main, ["predict", "--run", str(out), "--store", str(store), "--out",
                                     str(tmp_path / "p.csv")])
    assert pred.exit_code == 0, pred.output


def test_fed3r_lambda_follows_the_noise_of_every_round_summed():
    """Under partial participation each round adds a fresh draw to the Gram (std sigma sqrt(R) after
    R rounds): the solve's lambda grows with sqrt(R), so the system stays definite after 6 rounds."""
    fed = tiny_fed(D=30)
    Dp, rounds = 31, 6
    for seed in range(3):
        auto = _private_fed3r(2.0, seed)
        ss = run(auto, fed, rounds, fraction=0.5, seed=seed, progress=False).server_state
        lam = 0.01 + 2.0 * auto.noise_std["gram"] * math.sqrt(rounds * Dp)
        assert auto.inner.lam(Dp, rounds, auto.noise_std["gram"]) == pytest.approx(lam)
        assert float(torch.linalg.eigvalsh(ss.gram + lam * torch.eye(Dp, dtype=torch.float64)).min()) > 0
        assert not bool(ss.pinv)


def test_one_fed3r_object_runs_private_then_plain_as_two_fresh_ones():
    """The Gram's noise std reaches the solve with the noisy totals (RoundCtx.noise_std), not as an
    attribute of the algorithm: a Fed3R object reused after a private run solves with the plain
    lambda, and the private run's solve used the lambda of its noise."""
    fed = tiny_fed(D=30)
    Dp = 31  # the bias column
    alg = create_algorithm("fed3r")
    private = Private(alg, Mechanism(clip=1.0, noise_multiplier=1.0, noise_seed=0))
    noisy = run(private, fed, 1, progress=False).server_state
    assert alg.lam(Dp) == 0.01  # the plain lambda: nothing of the private run stays on the object
    plain = run(alg, fed, 1, progress=False).server_state
    fresh = run(create_algorithm("fed3r"), fed, 1, progress=False).server_state
    assert torch.equal(plain.weight, fresh.weight) and torch.equal(plain.bias, fresh.bias)
    sigma = private.noise_std["gram"]
    assert sigma > 0
    weight, bias, _, _ = alg.finalize(noisy.gram, noisy.sums, noisy.counts, 1, sigma)  # the solve under the noise
    assert torch.equal(noisy.weight, weight) and torch.equal(noisy.bias, bias)


def test_ccvr_records_a_saved_head_trained_without_dp_and_warns(tmp_path, caplog):
    store = _write_store(tmp_path)
    base = ["train", "--store", str(store), "--backbones", "synth", "--seeds", "0", "--device", "cpu", "--quiet"]
    assert CliRunner().invoke(main, [*base, "--algorithm", "fed3r", "--rounds", "1", "--out", str(tmp_path / "f3")]
                              ).exit_code == 0
    out = tmp_path / "cal"
    with caplog.at_level("WARNING"):
        r = CliRunner().invoke(main, [*base, "--algorithm", "ccvr", "--rounds", "1", "--dp-epsilon", "2",
                                      "--set", f"head={tmp_path / 'f3'}", "--out", str(out)])
    assert r.exit_code == 0, r.output
    post = json.loads((out / "results.json").read_text())["privacy"]["post_processing"]
    assert post["calibrated_head_privacy"] is None
    assert "trained without differential privacy" in caplog.text


@pytest.mark.parametrize("covariance", ["spherical", "diag"])
def test_fedpft_local_dp_sends_the_diagonal_where_the_type_reads_only_it(covariance):
    """spherical/diag noise sum x * x [M, C, D], not the [M, C, D, D] second moment (same
    sensitivity, clip^2), and fit the same Gaussians as the full matrix's diagonal would."""
    from fedheads.privacy import bounded

    fed = tiny_fed(M=4, D=6)
    alg = _fedpft(covariance=covariance)
    init = alg.init(fed.spec(), 0)
    _, stats, release = alg.local_form().stats(init.client_state, init.broadcast, bounded(fed, 1.0, "clip"), None)
    M, C, D = stats["sums"].shape
    assert stats["sq"].shape == (M, C, D)
    full = _fedpft(covariance="full")
    _, fstats, _ = full.local_form().stats(init.client_state, init.broadcast, bounded(fed, 1.0, "clip"), None)
    torch.testing.assert_close(stats["sq"], torch.diagonal(fstats["sq"], dim1=-2, dim2=-1), rtol=1e-12, atol=1e-12)
