"""Flower's simulation runtime (in process) against the engines: same data, same seeds.

- plain: equal to `engine="loop"` bit for bit (both run each client with M=1), and to the
  vectorised engine (`fedheads train`'s default) to float rounding;
- SecAgg+: within the stated quantisation bound (secure.error_bound), counts exact;
- the server never sees a secure field in the clear; a failing node is refused or, asked to,
  left out and reported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from flower_helpers import FLOWER_MISSING  # noqa: E402

pytest.importorskip("flwr", reason=FLOWER_MISSING)

from flower_helpers import write_store  # noqa: E402

from embedcache.errors import UserError  # noqa: E402
from fedheads.core.engine import run  # noqa: E402
from fedheads.core.tree import tree_leaves  # noqa: E402
from fedheads.flower.secure import error_bound, exponent  # noqa: E402
from fedheads.flower.sim import simulate_store  # noqa: E402
from fedheads.run.commands import FlowerRunConfig  # noqa: E402
from fedheads.run.load import load_fed_data  # noqa: E402
from fedheads.run.train import TrainOptions, build_algorithm  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("flsim"))


def engine_run(store, name, rounds, engine, clients=None, seed=0):
    data = load_fed_data(store, ["synth"], "cpu", clients=clients)
    alg, _, _ = build_algorithm(name, TrainOptions(), strict=True)
    return run(alg, data, rounds, seed=seed, engine=engine, progress=False)


def sim(store, name, rounds, **kw):
    return simulate_store(FlowerRunConfig(algorithm=name, backbones="synth", rounds=rounds, timeout=120, **kw), store)


@pytest.mark.parametrize("name,rounds", [("fedncm", 1), ("fedpcl", 3), ("fedavg", 2), ("fedproto", 2), ("lp", 2)])
def test_simulation_equals_the_engines(store, name, rounds):
    out = sim(store, name, rounds, seed=3)
    loop = engine_run(store, name, rounds, "loop", seed=3)
    vec = engine_run(store, name, rounds, "vectorized", seed=3)
    for got, ref in zip(tree_leaves(out["server_state"]), tree_leaves(loop.server_state)):
        assert got.dtype == ref.dtype and torch.equal(got, ref)  # bit for bit
    for got, ref in zip(tree_leaves(out["server_state"]), tree_leaves(vec.server_state)):
        assert torch.allclose(got.double(), ref.double(), rtol=1e-5, atol=1e-6)  # float rounding
    assert len(out["result"].history) == rounds
    for a, b in zip(out["result"].history, loop.history):
        assert a.participants == b.participants
        assert {k: v.tolist() for k, v in a.accuracy.items()} == {k: v.tolist() for k, v in b.accuracy.items()}


def test_secagg_fedncm_gives_the_class_means_within_the_bound(store):
    out = sim(store, "fedncm", 1, secagg=True)
    ref = engine_run(store, "fedncm", 1, "vectorized").server_state
    ss = out["server_state"]
    assert torch.equal(ss.counts, ref.counts)  # integers: exact
    data = load_fed_data(store, ["synth"], "cpu")
    from fedheads.algorithms.fedncm import client_stats

    sums, _ = client_stats(data.x_train, data.y_train, data.m_train, data.num_classes)
    bound = error_bound(3, max(exponent(s) for s in sums))
    err = (ss.sums - ref.sums).abs().max().item()
    assert 0 < err < bound  # quantised (not a plain sum), and within the stated bound
    assert (ss.means - ref.means).abs().max().item() < bound / ref.counts.min().item()
    assert out["result"].engine == "flower-secagg"


@pytest.mark.parametrize("name", ["fedproto", "fedpcl"])
def test_secagg_prototypes_match_the_engine(store, name):
    out = sim(store, name, 2, secagg=True)
    ref = engine_run(store, name, 2, "loop").server_state
    assert torch.allclose(out["server_state"].global_protos, ref.global_protos, atol=1e-5)
    assert torch.equal(out["server_state"].global_present, ref.global_present)


def test_under_secagg_the_server_never_receives_a_secure_field_in_the_clear(store):
    plain = sim(store, "fedncm", 1)["audit"]
    updates = [a for a in plain if a["type"] == "train.update"]
    assert updates and all("fh.message" in a["arrays"] for a in updates)
    audit = sim(store, "fedncm", 1, secagg=True)["audit"]
    updates = [a for a in audit if a["type"] == "train.update"]
    assert len(updates) == 3 and all(a["arrays"] == {} and "fh.exponents" in a["configs"] for a in updates)
    stages = [a for a in audit if a["type"] == "train"]
    assert len(stages) == 4 * 3  # setup, share keys, masked vectors, unmask; three nodes each
    masked = [a for a in stages if "masked_params" in a["configs"].get("secaggplus_configs", [])]
    assert len(masked) == 3 and all(all(v == [] for v in a["arrays"].values()) for a in masked)


class FailingNode:
    """The real ClientApp, except that `client` fails its update in `round_` (0-based); `dead`:
    it fails every update and evaluation from that round on (a node that went away)."""

    def __init__(self, client: str, round_: int, dead: bool = False) -> None:
        from fedheads.flower.node import app

        self.app, self.client, self.round, self.dead = app, client, round_, dead

    def __call__(self, message, context):
        run_cfg = message.content.config_records.get("fh.run")
        kind, mine = message.metadata.message_type, context.node_config["client"] == self.client
        r = json.loads(str(run_cfg["json"])).get("round", -1) if run_cfg is not None else -1
        if mine and kind == "train.update" and (r == self.round or (self.dead and r >= self.round)):
            raise RuntimeError("node lost its disk")
        if mine and self.dead and kind == "evaluate" and r >= self.round:
            raise RuntimeError("node lost its disk")
        return self.app(message=message, context=context)


def test_a_failing_node_stops_the_run_with_its_name_by_default(store, tmp_path):
    cfg = FlowerRunConfig(algorithm="fedpcl", backbones="synth", rounds=3, timeout=60, out=str(tmp_path / "run"))
    with pytest.raises(UserError, match=r"round 2: update: node c1 .*node lost its disk.*refused"):
        simulate_store(cfg, store, client_app=FailingNode("c1", 1))
    assert not (tmp_path / "run" / "results.json").exists()
    assert "node c1" in json.loads((tmp_path / "run" / "failed.json").read_text())["error"]


@pytest.mark.parametrize("secagg", [False, True])
def test_on_dropout_continue_completes_the_round_from_the_others_and_says_so(store, tmp_path, secagg):
    cfg = FlowerRunConfig(algorithm="fedncm", backbones="synth", rounds=1, timeout=60, on_dropout="continue",
                          secagg=secagg, out=str(tmp_path / "run"))
    out = simulate_store(cfg, store, client_app=FailingNode("c1", 0))
    ref = engine_run(store, "fedncm", 1, "loop", clients=["c0", "c2"]).server_state
    assert torch.equal(out["server_state"].counts, ref.counts)
    assert torch.allclose(out["server_state"].means, ref.means, rtol=0, atol=1e-6 if secagg else 0)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["flower"]["rounds"][0]["dropped"] == ["c1"] and res["flower"]["rounds"][0]["participants"] == ["c0", "c2"]


def test_a_node_gone_under_continue_is_filed_as_dropped_and_the_headline_counts_the_mean(store, tmp_path):
    """Not a client without test samples: it has them, it left. The mean is over the other two,
    and the one-line summary says so."""
    from fedheads.flower.commands import summary as one_line

    cfg = FlowerRunConfig(algorithm="fedncm", backbones="synth", rounds=1, timeout=60, on_dropout="continue",
                          out=str(tmp_path / "run"))
    simulate_store(cfg, store, client_app=FailingNode("c1", 0, dead=True))
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["clients_without_test"] == [] and res["clients_dropped"] == ["c1"]
    assert res["per_client"]["c1"] == {"mean": None, "std": None, "n_test": 30, "dropped": True}
    kept = [res["per_client"][c]["mean"] for c in ("c0", "c2")]
    assert res["accuracy"]["mean"] == pytest.approx(sum(kept) / 2)
    assert res["flower"]["rounds"][0]["eval_dropped"] == ["c1"]
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "n/a (dropped)" in summary and "no test samples" not in summary
    line = one_line(res, str(tmp_path / "run"))
    assert "over 2 of 3 nodes (c1 dropped)" in line, line


def test_summary_counts_the_bytes_flower_sent(store, tmp_path):
    """Under SecAgg+ no value goes in the clear, but bytes do: the run directory's byte totals
    are what Flower moved (the console's figure), never 0."""
    sim(store, "fedncm", 1, secagg=True, out=str(tmp_path / "run"))
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    fl, comm = res["flower"], res["communication"]
    assert fl["sent_bytes"] > 0 and fl["received_bytes"] > 0
    assert comm["upload_bytes_total"] == fl["received_bytes"] and comm["download_bytes_total"] == fl["sent_bytes"]
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert f"| upload_bytes_total | {fl['received_bytes']:,} |" in summary
    assert f"| download_bytes_total | {fl['sent_bytes']:,} |" in summary


def test_simulate_prints_one_line_per_round_and_logs_flower_to_the_run_dir(store, tmp_path):
    from click.testing import CliRunner

    from fedheads.cli import main

    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["simulate", "--store", str(store), "--backbones", "synth", "--algorithm", "fedncm",
                                  "--rounds", "2", "--secagg", "--out", str(out)])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["round 1/2", "round 2/2"] and len(lines) == 3, lines
    assert "3 nodes" in lines[0] and "bytes" in lines[0]
    assert "Secure aggregation commencing" in (out / "flower.log").read_text()


def test_run_directory_matches_fedheads_train(store, tmp_path):
    from fedheads.run.train import train_run

    sim(store, "fedpcl", 2, out=str(tmp_path / "fl"))
    ref = train_run(str(store), ["synth"], "fedpcl", TrainOptions(rounds=2, seeds=(0,), engine="loop", progress=False),
                    tmp_path / "ref")
    got = json.loads((tmp_path / "fl" / "results.json").read_text())
    for key in ("accuracy", "per_client", "history", "clients", "domains", "trainable_params_per_client"):
        assert got[key] == ref[key], key
    assert got["engine"] == "flower" and got["flower"]["sent_bytes"] > 0
    saved = torch.load(tmp_path / "fl" / "state" / "seed0.server.pt", weights_only=True)
    assert saved["format"] == "fedheads-flower-server-state/1"


def test_unsupported_secagg_is_one_line_before_any_round(store):
    with pytest.raises(UserError, match="secagg: fedavg has no secure form"):
        sim(store, "fedavg", 1, secagg=True)


def test_fedpcl_public_prototypes_reveal_the_counts_secagg_hides():
    """Why the docs say SecAgg+ protects nothing in FedPCL: Eq. 7 makes every local prototype
    public, and the secure total sum_i |D_ij| C_i^(j) is then a linear system in the counts."""
    from fed_tiny import tiny_fed

    from fedheads.algorithms import create_algorithm
    from fedheads.core.protocol import RoundCtx

    data = tiny_fed(M=4, D=6, C=3)
    alg = create_algorithm("fedpcl")
    init = alg.init(data.spec(), 0)
    _, msg = alg.client_update(init.client_state, init.broadcast, data, RoundCtx(0, 0, torch.arange(4), 4))
    w = (msg.counts * msg.present).double()
    total = (w.unsqueeze(-1) * msg.protos.double()).sum(0)  # what SecAgg+ gives the server, class by class
    for j in range(3):
        held = msg.present[:, j].nonzero().flatten()
        A = msg.protos[held, j].double().T  # [d, holders]: public (Eq. 7)
        recovered = torch.linalg.lstsq(A, total[j]).solution
        assert torch.equal(recovered.round(), w[held, j])


def test_importing_fedheads_flower_turns_flower_offline(tmp_path):
    """Even with the switches turned on in the environment: no telemetry POST, no update check."""
    code = ("import fedheads.flower, urllib.request, requests\n"
            "def no(*a, **k): raise AssertionError('network')\n"
            "urllib.request.urlopen = requests.post = no\n"
            "import flwr.supercore.telemetry as t, flwr.supercore.update_check as u\n"
            "u.warn_if_flwr_update_available('x')\n"
            "print(t.FLWR_TELEMETRY_ENABLED, t.create_event(t.EventType.PING, {}))\n")
    env = {**__import__("os").environ, "FLWR_TELEMETRY_ENABLED": "1", "FLWR_DISABLE_UPDATE_CHECK": "0",
           "FLWR_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "disabled"]
