"""Differential privacy of the training-free heads (fedheads.privacy): the noise has the
mechanism's variance, the epsilon reported is dp-accounting's own, calibration meets its target,
clipping bounds every example, vanishing noise gives the non-private head, an algorithm without
a DP form is refused, and a run's results.json records the mechanism."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from fed_tiny import tiny_fed
from store_doubles import assert_one_line
from test_fedheads_cli import _write_store

import fedheads
from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.cli import main
from fedheads.core.engine import run
from fedheads.privacy import Mechanism, Private, bound_rows, calibrate, epsilon, noise_stds


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _write_store(tmp_path_factory.mktemp("dp"))


def _private(**kw) -> Private:
    return Private(create_algorithm("fedncm"), Mechanism(**{"noise_seed": 7, **kw}))


def _totals_noise(alg: Private, rounds: int) -> dict[str, np.ndarray]:
    """Noise on the totals the algorithm finalizes from (noisy minus exact, each field divided by
    its mechanism std: N(0, 1) entries), over `rounds` rounds of every client; read by a spy in
    place of FedNCM's aggregate, declaring no integer field so nothing is clamped."""
    from fedheads.core.protocol import RoundCtx, SecureForm

    fed = tiny_fed(M=5, D=4, C=3)
    init = alg.init(fed.spec(), 0)
    exact = alg.inner.client_update(init.client_state.inner, init.broadcast, _bounded(fed, alg), None)[1]
    want = {"sums": exact.sums.sum(0).double(), "counts": exact.counts.sum(0).double()}
    seen: list[dict[str, torch.Tensor]] = []
    real = alg.inner.secure_form()

    def spy(ss, clear, tot, ctx):
        seen.append(tot)
        return ss, init.broadcast

    alg.inner.secure_form = lambda message=None: SecureForm(real.sums, (), real.clear, spy)
    for r in range(rounds):
        ctx = RoundCtx(r, 0, torch.arange(fed.num_clients), fed.num_clients)
        _, msg = alg.client_update(init.client_state, init.broadcast, fed, ctx)
        alg.server_aggregate(init.server_state, msg, ctx)
    return {k: np.concatenate([((t[k] - want[k]) / alg.noise_std[k]).reshape(-1).numpy() for t in seen])
            for k in want}


def _bounded(fed, alg):
    from fedheads.privacy import bounded

    return bounded(fed, alg.mech.clip, alg.mech.transform)


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_noise_has_the_mechanisms_variance(mode):
    alg = _private(noise_multiplier=0.7, clip=2.0, mode=mode)
    # sigma_f = z * Delta_f * sqrt(F) with an equal split over F = 2 fields
    assert alg.noise_std == pytest.approx({"sums": 0.7 * 2.0 * math.sqrt(2), "counts": 0.7 * math.sqrt(2)})
    noise = _totals_noise(alg, rounds=300)
    for k, v in noise.items():
        n = v.size  # the sample variance of n standard normals: mean 1, std sqrt(2/n)
        assert abs(v.var() - 1.0) < 5 * math.sqrt(2.0 / n), (k, v.var(), n)
        assert abs(v.mean()) < 5 / math.sqrt(n), (k, v.mean())


def test_a_budget_split_keeps_the_joint_noise_multiplier():
    sens = {"sums": 3.0, "counts": 1.0, "fixed": 0.0}
    std = noise_stds(sens, 2.0, (("sums", 0.9), ("counts", 0.1)))
    # one Gaussian mechanism of multiplier z: sum_f (Delta_f / sigma_f)^2 = 1 / z^2
    assert sum((sens[k] / s) ** 2 for k, s in std.items() if s) == pytest.approx(1 / 2.0 ** 2)
    assert std["fixed"] == 0.0 and std["sums"] == pytest.approx(2.0 * 3.0 / math.sqrt(0.9))
    with pytest.raises(UserError, match="--dp-split nope"):
        noise_stds(sens, 1.0, (("nope", 1.0),))


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("releases", [1, 3])
def test_epsilon_is_dp_accountings_own(accountant, releases):
    z, delta = 1.3, 1e-6
    # the PLD grid fedheads.privacy uses at this z (results.json's pld_value_discretization_interval)
    acc = dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else \
        dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(dp_accounting.GaussianDpEvent(z), releases)
    assert epsilon(z, delta, releases, accountant) == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    if releases == 1 and accountant == "pld":  # the analytic Gaussian (Balle & Wang 2018) agrees
        assert epsilon(z, delta, 1, "pld") == pytest.approx(dp_accounting.get_epsilon_gaussian(z, delta), rel=1e-3)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("target", [0.5, 4.0])
def test_calibration_meets_the_target_closely(accountant, target):
    z = calibrate(target, 1e-5, 1, accountant)
    eps = epsilon(z, 1e-5, 1, accountant)
    assert eps <= target and eps > 0.999 * target
    assert epsilon(z * 0.99, 1e-5, 1, accountant) > target  # and no less noise would do


def test_clipping_bounds_every_example_and_leaves_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g) * torch.tensor([0.1, 1, 10]).view(3, 1, 1)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    x[0, 3:] = 0.0
    c = bound_rows(x, mask, 1.5, "clip")
    assert float(c.norm(dim=-1).max()) <= 1.5 * (1 + 1e-6)
    small = x.norm(dim=-1) <= 1.5
    assert torch.equal(c[small], x[small])  # features already inside the ball are untouched
    n = bound_rows(x, mask, 1.5, "normalize")
    assert torch.allclose(n.norm(dim=-1)[mask], torch.full((int(mask.sum()),), 1.5))
    assert torch.equal(n[~mask], x[~mask])


def test_the_client_message_is_built_from_clipped_features():
    alg = _private(noise_multiplier=1.0, clip=0.5)
    fed = tiny_fed()
    init = alg.init(fed.spec(), 0)
    from fedheads.core.protocol import RoundCtx

    ctx = RoundCtx(0, 0, torch.arange(fed.num_clients), fed.num_clients)
    _, msg = alg.client_update(init.client_state, init.broadcast, fed, ctx)
    # each client's class sum of n clipped features has norm <= 0.5 n
    assert bool((msg.sums["sums"].norm(dim=-1) <= 0.5 * msg.sums["counts"] + 1e-6).all())


@pytest.mark.parametrize("mode", ["central", "distributed"])
@pytest.mark.parametrize("engine", ["vectorized", "loop"])
def test_vanishing_noise_gives_the_non_private_head(mode, engine):
    fed = tiny_fed()
    plain = run(create_algorithm("fedncm"), fed, 1, progress=False)
    big = float(fed.x_train.norm(dim=-1).max()) * 2  # no feature is clipped
    alg = _private(noise_multiplier=1e-12, clip=big, mode=mode)
    res = run(alg, fed, 1, progress=False, engine=engine)
    assert torch.equal(res.server_state.present, plain.server_state.present)
    torch.testing.assert_close(res.server_state.means, plain.server_state.means, rtol=0, atol=1e-8)
    assert torch.equal(res.final_accuracy(), plain.final_accuracy())
    assert alg.releases(res.client_state) == 1


def test_partial_participation_releases_each_client_once():
    fed = tiny_fed(M=6)
    alg = _private(epsilon=2.0, clip=1.0)
    res = run(alg, fed, 6, fraction=0.5, progress=False)
    assert res.client_state.releases.tolist() == [1] * 6  # a client that has sent sends zeros
    rep = alg.report([alg.releases(res.client_state)] * 2)
    assert rep["releases_per_example"] == 1 and rep["epsilon"] <= 2.0
    assert rep["epsilon_all_seeds"] == pytest.approx(epsilon(alg.z, 1e-5, 2, "rdp"))  # two seeds: two releases


def test_noisy_counts_are_clamped_so_every_class_stays_predictable():
    fed = tiny_fed()
    alg = _private(noise_multiplier=50.0, clip=1.0)  # count noise std ~70 on counts of ~10
    res = run(alg, fed, 1, progress=False)
    ss = res.server_state
    assert int(ss.counts.min()) >= 1 and bool(ss.present.all())
    assert bool(torch.isfinite(ss.means).all()) and res.final_accuracy().shape == (fed.num_clients,)


def test_an_algorithm_without_a_dp_form_is_refused(store, tmp_path):
    with pytest.raises(UserError, match="dp: fedavg has no differentially private form"):
        Private(create_algorithm("fedavg"), Mechanism(epsilon=1.0))
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedavg",
                                    "--rounds", "1", "--seeds", "0", "--device", "cpu", "--quiet",
                                    "--dp-epsilon", "1", "--out", str(tmp_path / "r")])
    assert_one_line(res, 2, "fedavg has no differentially private form")
    for bad, needle in ((["--dp-epsilon", "1", "--dp-noise-multiplier", "1"], "exactly one of"),
                        (["--dp-epsilon", "1", "--dp-delta", "2"], "--dp-delta 2.0")):
        res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm",
                                        "fedncm", "--seeds", "0", "--out", str(tmp_path / "q"), *bad])
        assert_one_line(res, 2, needle)


def test_cli_run_records_the_mechanism_in_results_json(store, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedncm",
                                    "--rounds", "1", "--seeds", "0,1", "--device", "cpu", "--quiet",
                                    "--dp-epsilon", "3", "--dp-delta", "1e-6", "--dp-clip", "2",
                                    "--dp-accountant", "pld", "--out", str(out)])
    assert res.exit_code == 0, res.output
    p = json.loads((out / "results.json").read_text())["privacy"]
    assert p["mechanism"] == "gaussian" and p["mode"] == "central" and p["clip"] == 2.0
    assert p["delta"] == 1e-6 and p["accountant"] == "pld" and p["releases_per_example"] == 1
    assert p["epsilon"] <= 3.0 and p["epsilon"] == pytest.approx(epsilon(p["noise_multiplier"], 1e-6, 1, "pld"))
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=p["pld_value_discretization_interval"])
    acc.compose(dp_accounting.GaussianDpEvent(p["noise_multiplier"]))
    assert p["epsilon"] == pytest.approx(acc.get_epsilon(1e-6), rel=1e-9)  # dp-accounting's own, as recorded
    assert p["noise_std"]["sums"] == pytest.approx(p["noise_multiplier"] * 2.0 * math.sqrt(2))
    assert p["epsilon_all_seeds"] > p["epsilon"]
    # the saved state is the plain algorithm's: `fedheads predict` serves the private head
    pred = CliRunner().invoke(main, ["predict", "--run", str(out), "--store", str(store), "--out",
                                     str(tmp_path / "p.csv")])
    assert pred.exit_code == 0, pred.output
    cfg = (out / "config.yaml").read_text()
    assert "dp_epsilon: 3.0" in cfg and "dp_accountant: pld" in cfg


def test_api_takes_a_mapping_and_compare_refuses_without_dp_form():
    from fed_tiny import tiny_fed as tf

    fed = tf()
    r = fedheads.train(fed, "fedncm", rounds=1, seeds=0, device="cpu",
                       dp={"noise_multiplier": 2.0, "clip": 1.0, "mode": "distributed", "noise_seed": 1})
    assert r.privacy["mode"] == "distributed" and r.privacy["noise_multiplier"] == 2.0
    with pytest.raises(UserError, match="dp: unknown field 'eps'"):
        fedheads.train(fed, "fedncm", rounds=1, seeds=0, dp={"eps": 1.0})
    with pytest.raises(UserError, match="lp has no differentially private form"):
        fedheads.compare(fed, "fedncm,lp", rounds=1, seeds=0, device="cpu", dp={"epsilon": 1.0})


def test_privacy_utility_benchmark_writes_its_curve(store, tmp_path, monkeypatch, drawn):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_privacy_utility as bench

    monkeypatch.setattr(bench, "features", lambda *a: (store, "synth"))
    out = tmp_path / "pu.json"
    res = bench.main(["--epsilons", "0.5,50", "--seeds", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert set(saved["curves"]) == {"central", "distributed"} and saved["non_private"]["accuracy_mean"] > 0
    for pts in res["curves"].values():
        assert [p["target_epsilon"] for p in pts] == [0.5, 50.0]
        assert all(p["epsilon"] <= p["target_epsilon"] for p in pts)
        assert pts[0]["noise_multiplier"] > pts[1]["noise_multiplier"]
    assert len(drawn) == 1 and drawn[0].axes[0].get_xscale() == "log"


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_the_noise_is_the_same_in_both_engines_and_any_client_order(mode):
    fed = tiny_fed(M=5)
    mech = Mechanism(noise_multiplier=1.0, clip=1.0, mode=mode, noise_seed=5)
    vec = run(Private(create_algorithm("fedncm"), mech), fed, 1, seed=4, progress=False).server_state
    loop = run(Private(create_algorithm("fedncm"), mech), fed, 1, seed=4, engine="loop", progress=False).server_state
    perm = [3, 1, 4, 0, 2]  # the clients stacked in another order, global ids kept (largest-first training)
    shuffled = run(Private(create_algorithm("fedncm"), mech), fed.select(perm), 1, seed=4, progress=False).server_state
    for other in (loop, shuffled):
        torch.testing.assert_close(other.sums, vec.sums, rtol=0, atol=1e-9)
        assert torch.equal(other.counts, vec.counts)
    other_seed = run(Private(create_algorithm("fedncm"), mech), fed, 1, seed=5, progress=False).server_state
    assert not torch.allclose(other_seed.sums, vec.sums)  # each run seed draws its own noise


def test_dp_options_parse_into_one_mechanism():
    """The --dp-* options (fedheads.run.commands: the mechanism's fields under the prefix dp) build
    one Mechanism when any is given, and what --dump-config writes reads back to it."""
    from fedheads.run.commands import TrainOptions
    from fedheads.run.options import build, file_config

    assert build(TrainOptions, {}).dp is None  # no --dp-* option: no DP
    m = build(TrainOptions, {"dp_epsilon": 2.0, "dp_split": "sums=0.9, counts=0.1", "dp_mode": "distributed"}).dp
    assert m == Mechanism(epsilon=2.0, mode="distributed", split=(("sums", 0.9), ("counts", 0.1)))
    assert build(TrainOptions, file_config(TrainOptions(dp=m))).dp == m  # what --dump-config writes reads back
    with pytest.raises(UserError, match="--dp-split 'sums': expected FIELD=WEIGHT"):
        build(TrainOptions, {"dp_epsilon": 2.0, "dp_split": "sums"})
    with pytest.raises(UserError, match="give exactly one of --dp-epsilon and --dp-noise-multiplier"):
        build(TrainOptions, {"dp_clip": 2.0})  # a --dp-* option alone is not silently ignored
    with pytest.raises(UserError, match="--dp-split: give a weight for every field"):
        _private(noise_multiplier=1.0, split=(("sums", 1.0),))


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_fed3r_under_vanishing_noise_gives_its_non_private_head(mode):
    """The wrapper needs nothing from an algorithm but its secure form and sensitivities: Fed3R's
    Gram, class sums and counts (fed3r.py) go through it unchanged."""
    from fedheads.privacy import Mechanism, Private

    fed = tiny_fed()
    plain = run(create_algorithm("fed3r"), fed, 1, progress=False)
    big = float(fed.x_train.norm(dim=-1).max()) * 2  # no feature is clipped
    alg = Private(create_algorithm("fed3r"), Mechanism(clip=big, noise_multiplier=1e-12, mode=mode, noise_seed=0))
    res = run(alg, fed, 1, progress=False)
    w, pw = alg.linear_head(res.server_state), create_algorithm("fed3r").linear_head(plain.server_state)
    assert w is not None and pw is not None
    for k in pw:
        torch.testing.assert_close(w[k], pw[k], rtol=0, atol=1e-6)
    assert torch.equal(res.final_accuracy(), plain.final_accuracy())


def test_private_passes_on_every_declaration_of_the_protocol(monkeypatch):
    """A declaration added to AlgorithmBase reaches Private without a hand-kept list: the wrapped
    algorithm's value, not the protocol's default."""
    from fedheads.core.protocol import AlgorithmBase

    monkeypatch.setitem(AlgorithmBase.__annotations__, "new_hook", "ClassVar[str]")
    monkeypatch.setattr(AlgorithmBase, "new_hook", "default", raising=False)
    inner_cls = type(create_algorithm("fedncm"))
    Extended = type("Extended", (inner_cls,), {"new_hook": "the inner's", "global_rule": "other",
                                                "server_sized_fields": ("x",), "collect_rounds": 3})
    inner = Extended(create_algorithm("fedncm").cfg)
    alg = Private(inner, Mechanism(noise_multiplier=1.0))
    assert alg.new_hook == "the inner's"
    for k in AlgorithmBase.__annotations__:
        if k not in ("sums_messages", "update_replaces"):  # Private's own message and client state
            assert getattr(alg, k) == getattr(inner, k), k
    assert inner.sums_messages and not alg.sums_messages
    fedavg = create_algorithm("fedavg")
    assert fedavg.update_replaces and Private.update_replaces == ()  # fields of FedAvg's state, not Private's


def test_private_handles_every_optional_hook_of_the_protocol():
    """Hooks take and return states, which Private wraps: each is overridden in Private, except
    those that never apply to it (a summed_update: Private does not declare sums_messages; a
    private algorithm is not made private again), so a hook added to the protocol fails here."""
    from fedheads.core.protocol import AlgorithmBase

    hooks = {k for k, v in vars(AlgorithmBase).items() if callable(v) and not k.startswith("_")}
    left = {k for k in hooks if getattr(Private, k) is getattr(AlgorithmBase, k)}
    assert left == {"summed_update", "dp_sensitivity", "dp_finalize", "local_form"}


@pytest.mark.parametrize("bad,needle", [
    (["--dp-epsilon", "1e300"], "above 1000"),
    (["--dp-epsilon", "1e20"], "above 1000"),
    (["--dp-epsilon", "1", "--dp-clip", "1e300"], "--dp-clip 1e+300"),
    (["--dp-epsilon", "1", "--dp-split", "gram=1e300,sums=1e-300,counts=1"], "--dp-split"),
])
def test_dp_extremes_are_one_line_without_library_warnings(store, tmp_path, bad, needle):
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fed3r",
                                    "--seeds", "0", "--quiet", "--out", str(tmp_path / "q"), *bad])
    assert_one_line(res, 2, needle)
    assert "Warning" not in res.output and not (tmp_path / "q" / "results.json").exists()


def test_a_release_that_protects_nothing_says_so_in_strict_json(store, tmp_path):
    """--dp-noise-multiplier 1e-300: epsilon is infinite; the console and results.json say the run
    guarantees nothing, and results.json stays strict JSON (null, not Infinity)."""
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fed3r",
                                    "--seeds", "0", "--quiet", "--dp-noise-multiplier", "1e-300", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "protects nothing" in res.output and "Warning" not in res.output

    def refuse(c):
        raise ValueError(f"not strict JSON: {c}")

    p = json.loads((out / "results.json").read_text(), parse_constant=refuse)["privacy"]
    assert p["epsilon"] is None and "protects nothing" in p["guarantee"]


def test_the_console_says_the_epsilon_spent_per_seed_and_in_all(store, tmp_path):
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fed3r",
                                    "--seeds", "0,1", "--quiet", "--dp-epsilon", "1", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("privacy:"))
    p = json.loads((tmp_path / "r" / "results.json").read_text())["privacy"]
    assert f"({p['epsilon']:.3g}, 1e-05)-DP per seed" in line and f"({p['epsilon_all_seeds']:.3g}, 1e-05)-DP" in line


def test_split_weights_of_any_size_are_scaled_first():
    sens = {"a": 1.0, "b": 2.0}
    small = noise_stds(sens, 1.0, (("a", 1.0), ("b", 3.0)))
    torch.testing.assert_close(torch.tensor(list(noise_stds(sens, 1.0, (("a", 1e300), ("b", 3e300))).values())),
                               torch.tensor(list(small.values())))
