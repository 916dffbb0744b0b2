"""Differential privacy over Flower (fedheads/flower/dp.py) in Flower's simulation runtime (in
process): the run config's dp_* fields give the server `Private(alg, mech)` and every node the
same mechanism with its own noise key. With the key fixed (simulation only: each virtual node gets
it in its node config) a run equals the engine's Private run: bit for bit in the clear, within
SecAgg+'s quantisation under it. results.json carries `fedheads train`'s privacy block; no
message or run config reaching a node holds a noise key; bad DP input is one line, before any
server starts."""

from __future__ import annotations

import json

import pytest
import torch
from flower_helpers import FLOWER_MISSING  # noqa: E402

pytest.importorskip("flwr", reason=FLOWER_MISSING)

from click.testing import CliRunner  # noqa: E402
from flower_helpers import write_store  # noqa: E402

import fedheads.algorithms as registry  # noqa: E402
from embedcache.errors import UserError  # noqa: E402
from fedheads.cli import main  # noqa: E402
from fedheads.core.engine import run  # noqa: E402
from fedheads.core.tree import tree_leaves  # noqa: E402
from fedheads.flower import dp as flower_dp  # noqa: E402
from fedheads.flower.secure import error_bound, exponent  # noqa: E402
from fedheads.flower.sim import simulate_store  # noqa: E402
from fedheads.privacy import Mechanism, Private, bounded  # noqa: E402
from fedheads.run.commands import FlowerRunConfig  # noqa: E402
from fedheads.run.load import load_fed_data  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("dpfl"))


def dp_cfg(mode, secagg=False, **kw):
    kw = {"rounds": 1, **kw}
    return FlowerRunConfig(algorithm="fedncm", backbones="synth", timeout=120, seed=2, secagg=secagg,
                           dp_noise_multiplier=0.5, dp_clip=3.0, dp_mode=mode, **kw)


def engine_private(store, mode, z=0.5, rounds=1, **kw):
    mech = Mechanism(noise_multiplier=z, clip=3.0, mode=mode, noise_seed=11)
    return run(Private(registry.create_algorithm("fedncm"), mech), load_fed_data(store, ["synth"], "cpu"), rounds,
               seed=2, engine="loop", progress=False, **kw)


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_in_the_clear_a_private_run_equals_the_engines_bit_for_bit(store, mode):
    out = simulate_store(dp_cfg(mode), store, noise_seed=11)
    ref = engine_private(store, mode)
    for got, want in zip(tree_leaves(out["server_state"]), tree_leaves(ref.server_state)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert {k: v.tolist() for k, v in out["result"].history[-1].accuracy.items()} == \
        {k: v.tolist() for k, v in ref.history[-1].accuracy.items()}
    # and the noise is there: the clipped, noiseless sums are elsewhere
    data = bounded(load_fed_data(store, ["synth"], "cpu"), 3.0, "clip")
    from fedheads.algorithms.fedncm import client_stats

    sums, _ = client_stats(data.x_train, data.y_train, data.m_train, data.num_classes)
    assert (out["server_state"].sums - sums.sum(0)).abs().max().item() > 0.1
    assert out["privacy"] == Private(registry.create_algorithm("fedncm"),
                                     Mechanism(noise_multiplier=0.5, clip=3.0, mode=mode, noise_seed=11)).report([1])


def test_fed3r_under_dp_equals_the_engines_private_run(store):
    """The other head with a DP form (its Grams noised too): the same plumbing, the same state."""
    mode = "distributed"
    cfg = FlowerRunConfig(algorithm="fed3r", backbones="synth", rounds=1, timeout=120, seed=2, dp_noise_multiplier=0.5,
                          dp_clip=3.0, dp_mode=mode)
    out = simulate_store(cfg, store, noise_seed=11)
    mech = Mechanism(noise_multiplier=0.5, clip=3.0, mode=mode, noise_seed=11)
    ref = run(Private(registry.create_algorithm("fed3r"), mech), load_fed_data(store, ["synth"], "cpu"), 1, seed=2,
              engine="loop", progress=False)
    for got, want in zip(tree_leaves(out["server_state"]), tree_leaves(ref.server_state)):
        assert torch.equal(got, want)
    assert set(out["privacy"]["noise_std"]) == set(Private(registry.create_algorithm("fed3r"), mech).noise_std)


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_secagg_carries_the_same_noise_as_the_engine(store, mode):
    out = simulate_store(dp_cfg(mode, secagg=True), store, noise_seed=11)
    ref = engine_private(store, mode).server_state
    ss = out["server_state"]
    assert torch.equal(ss.counts, ref.counts)
    # SecAgg+'s quantisation only: each node's noisy sums are below 2^E
    assert 0 < (ss.sums - ref.sums).abs().max().item() < error_bound(3, exponent(ref.sums))
    assert out["result"].engine == "flower-secagg"
    updates = [a for a in out["audit"] if a["type"] == "train.update"]
    assert len(updates) == 3 and all(a["arrays"] == {} and flower_dp.RELEASES in a["configs"] for a in updates)


def test_releases_are_counted_on_the_nodes_under_partial_participation(store):
    """FedNCM sends each client's statistics once, whatever the rounds: epsilon is one release's."""
    out = simulate_store(dp_cfg("distributed", rounds=3, fraction=0.67, eval_every=0), store, noise_seed=11)
    ref = engine_private(store, "distributed", rounds=3, fraction=0.67, eval_every=0)
    for got, want in zip(tree_leaves(out["server_state"]), tree_leaves(ref.server_state)):
        assert torch.equal(got, want)
    assert out["privacy"]["releases_per_example"] == 1 == int(ref.client_state.releases.max())
    assert [len(r.participants) for r in out["result"].history] == [2, 2, 2]


class Recorder:
    """The real ClientApp, recording what every message and run config brings a node."""

    def __init__(self) -> None:
        from fedheads.flower.node import app

        self.app, self.seen = app, []

    def __call__(self, message, context):
        rec = message.content.config_records.get("fh.run")
        self.seen.append((None if rec is None else json.loads(str(rec["json"])), dict(context.run_config)))
        return self.app(message=message, context=context)


def test_no_noise_key_ever_reaches_a_node(store, tmp_path):
    rec = Recorder()
    out = simulate_store(dp_cfg("central", out=str(tmp_path / "run")), store, client_app=rec)
    runs = [r for r, _ in rec.seen if r is not None and "round" in r]  # update and evaluate (describe: no run)
    assert runs and all(set(r["dp"]) == {"clip", "transform", "mode", "noise_multiplier", "split", "noise_std"}
                        for r in runs)
    assert all(not any("noise_seed" in k or "noise-seed" in k for k in rc) for _, rc in rec.seen)
    assert out["privacy"]["noise_seed"] == "secret"
    assert json.loads((tmp_path / "run" / "results.json").read_text())["privacy"] == out["privacy"]


def test_a_node_whose_mechanism_differs_refuses_the_round_in_one_line(store):
    class OtherVersion(Recorder):
        def __call__(self, message, context):  # a node whose fedheads computes other noise scales
            rec = message.content.config_records.get("fh.run")
            run_ = json.loads(str(rec["json"])) if rec is not None else {}
            if run_.get("dp") and context.node_config["client"] == "c1":
                run_["dp"]["noise_std"]["sums"] *= 2
                rec["json"] = json.dumps(run_)
            return self.app(message=message, context=context)

    with pytest.raises(UserError, match=r"round 1: update: node c1 .*node c1: its DP noise scales .* differ from the "
                                        r"server's") as err:
        simulate_store(dp_cfg("distributed"), store, client_app=OtherVersion(), noise_seed=1)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="node c2: its update carries no DP release count"):
        flower_dp.reported_releases({}, "c2")


def test_simulate_writes_trains_privacy_block(store, tmp_path):
    dp = ["--dp-epsilon", "4", "--dp-clip", "2", "--dp-mode", "distributed", "--dp-noise-seed", "3"]
    sim = CliRunner().invoke(main, ["simulate", "--store", str(store), "--backbones", "synth", "--algorithm", "fedncm",
                                    "--secagg", "--timeout", "120", "--out", str(tmp_path / "fl"), *dp])
    assert sim.exit_code == 0, sim.output
    train = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedncm",
                                      "--rounds", "1", "--seeds", "0", "--quiet", "--out", str(tmp_path / "tr"), *dp])
    assert train.exit_code == 0, train.output
    got, want = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("fl", "tr"))
    assert got["privacy"] == want["privacy"] and got["privacy"]["epsilon"] <= 4.0
    assert got["privacy"]["noise_seed"] == 3 and got["privacy"]["mode"] == "distributed"
    cfg = json.loads((tmp_path / "fl" / "config.json").read_text())["flower"]
    assert cfg["dp_epsilon"] == 4.0 and cfg["dp_mode"] == "distributed" and "dp_noise_seed" not in cfg


def _one_line(res, needle):
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], res.output


def test_serve_refuses_dp_input_in_one_line_before_any_server_starts(store, tmp_path):
    base = ["serve", "--nodes", "2", "--backbones", "synth", "--wait", "1"]
    for args, needle in ((["--algorithm", "fedavg", "--dp-epsilon", "1"], "fedavg has no differentially private form"),
                         (["--algorithm", "fedncm", "--dp-noise-multiplier", "1", "--dp-noise-seed", "4"],
                          "--dp-noise-seed: simulation only"),
                         (["--algorithm", "fedncm", "--dp-epsilon", "0"], "--dp-epsilon 0.0: must be a positive"),
                         (["--algorithm", "fedncm", "--dp-epsilon", "1", "--dp-split", "sums=1"],
                          "--dp-split: give a weight for every field")):
        out = tmp_path / "run"
        _one_line(CliRunner().invoke(main, [*base, *args, "--out", str(out)]), needle)
        assert not out.exists() and not (tmp_path / ".run.flower").exists()  # no SuperLink's home: none started
    _one_line(CliRunner().invoke(main, ["simulate", "--store", str(store), "--backbones", "synth", "--algorithm", "lp",
                                        "--dp-noise-multiplier", "1", "--out", str(tmp_path / "s")]),
              "lp has no differentially private form")
    _one_line(CliRunner().invoke(main, ["simulate", "--store", str(store), "--backbones", "synth", "--algorithm",
                                        "fedncm", "--dp-noise-multiplier", "1", "--dp-mode", "distributed",
                                        "--on-dropout", "continue", "--out", str(tmp_path / "s")]),
              "a dropped node's noise share would be missing")
    with pytest.raises(UserError, match="--dp-noise-multiplier -1"):
        FlowerRunConfig(backbones="synth", dp_noise_multiplier=-1)


def test_serve_hands_flower_the_public_mechanism_only(tmp_path, monkeypatch):
    """The run config `serve` writes into the Flower App (every node receives it) holds the
    mechanism's parameters and no noise key; distributed noise without SecAgg+ is pointed out."""
    from fedheads.flower import deploy

    seen = {}

    def fake_serve(run_config, out, **kw):
        seen.update(run_config)
        raise UserError("stopped before the SuperLink")

    monkeypatch.setattr(deploy, "serve", fake_serve)
    res = CliRunner().invoke(main, ["serve", "--nodes", "2", "--algorithm", "fed3r", "--backbones", "synth",
                                    "--dp-epsilon", "2", "--dp-mode", "distributed", "--out", str(tmp_path / "r")])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and lines[-1] == "error: stopped before the SuperLink", res.output
    assert lines[0].startswith("note: --dp-mode distributed without --secagg"), res.output
    assert seen["dp-epsilon"] == 2.0 and seen["dp-mode"] == "distributed" and seen["dp-noise-multiplier"] == 0.0
    assert not [k for k in seen if "seed" in k and k != "seed"]


def test_fedpft_in_local_mode_equals_the_engines_private_run(store):
    """Local DP (each node noises its own class statistics, FedPFT) runs over Flower unchanged."""
    cfg = FlowerRunConfig(algorithm="fedpft", backbones="synth", rounds=1, timeout=120, seed=2, dp_noise_multiplier=0.5,
                          dp_clip=3.0, dp_mode="local")
    out = simulate_store(cfg, store, noise_seed=11)
    mech = Mechanism(noise_multiplier=0.5, clip=3.0, mode="local", noise_seed=11)
    ref = run(Private(registry.create_algorithm("fedpft"), mech), load_fed_data(store, ["synth"], "cpu"), 1, seed=2,
              engine="loop", progress=False)
    for got, want in zip(tree_leaves(out["server_state"]), tree_leaves(ref.server_state)):
        assert torch.equal(got, want)
    assert out["privacy"]["mode"] == "local" and out["privacy"]["releases_per_example"] == 1
