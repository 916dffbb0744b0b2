"""Smoke tests of the cached-vs-live benchmark (benchmarks/bench_cached_vs_live.py) and its
live-backbone FedPCL baseline (benchmarks/live_fedpcl.py), on a tiny image folder with tiny
contract-3 backbones (tests/store_doubles.py). Whole file: a few seconds."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import store_doubles as d
import torch

from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig
from fedheads.core.engine import run
from fedheads.core.federation import FedData
from fedheads.run.load import from_arrays

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_cached_vs_live as bench  # noqa: E402
from live_fedpcl import LiveConfig, RoundBatches, run_live  # noqa: E402

CFG = FedPCLConfig(batch_size=4)  # several steps per round, last batch partial


@dataclass
class CountingSource(d.FolderSource):
    """Counts image loads (num_workers=0: the loads happen in this process)."""

    loads: int = 0

    def load(self, locator: str):
        self.loads += 1
        return super().load(locator)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny convolutions on a shared 2-core machine: one intra-op thread is several times faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = d.make_imagefolder(tmp_path_factory.mktemp("img"), domains=("a", "b", "c"), per_class=8)
    return root, d.make_manifest(root, test_every=3)  # 5 train + 3 test per class and domain


def _engine_data(manifest, source, backbones) -> FedData:
    """The cached path: features computed once per image, stacked for the engine."""
    def feats(samples):
        xs = torch.stack([backbones[0].transform(source.load(s.locator)) for s in samples])
        return torch.cat([bb.embed(xs) for bb in backbones], 1).numpy(), torch.tensor([s.label for s in samples]).numpy()

    arrs = [(*feats(c.train), *feats(c.test)) for c in manifest.clients]
    return from_arrays(arrs, len(manifest.classes), [c.name for c in manifest.clients],
                               [c.domain for c in manifest.clients])


def test_live_equals_cached_engine_on_the_same_batches(tiny):
    """With the engine's batch schedule the live loop IS the cached FedPCL run (up to float
    rounding), and it decodes every image in every pass: nothing is cached."""
    root, m = tiny
    bbs = [d.TinyBackbone("tiny"), d.TinyBackbone("tiny2", seed=1)]
    src = CountingSource(str(root))
    rounds = 3
    live = run_live(m, src, bbs, LiveConfig(rounds=rounds, num_workers=0, batch_order="engine", fedpcl=CFG,
                                            eval_batch_size=5, progress=False))
    ref = run(FedPCL(CFG), _engine_data(m, d.FolderSource(str(root)), bbs), rounds, seed=0, progress=False)

    for lr, er in zip(live.rounds, ref.history):
        assert list(lr.accuracy) == pytest.approx(er.accuracy["main"].tolist(), abs=1e-12)
    cs, ref_cs = live.client_state, ref.client_state
    assert torch.allclose(cs.protos, ref_cs.protos, atol=1e-4)
    for k in ref_cs.params:
        # Adam turns float-noise gradients (BN cancels the bias for always-active units) into
        # ~1e-5 steps; a missed or extra step would move parameters by ~lr = 1e-3
        assert torch.allclose(cs.params[k], ref_cs.params[k], atol=1e-4), k
    assert torch.allclose(live.server_state.global_protos, ref.server_state.global_protos, atol=1e-4)
    # the heads did train (round 0 only collects prototypes; rounds 1-2 take Adam steps)
    init = FedPCL(CFG).init(_engine_data(m, d.FolderSource(str(root)), bbs).spec(), 0).client_state
    assert not torch.allclose(cs.params["proj.weight"], init.params["proj.weight"])

    n_tr = sum(len(c.train) for c in m.clients)
    n_te = sum(len(c.test) for c in m.clients)
    per_train_round = 2 * n_tr + n_te  # training batches, prototypes, test
    assert [r.images_decoded for r in live.rounds] == [n_tr + n_te] + [per_train_round] * (rounds - 1)
    assert src.loads == (n_tr + n_te) + (rounds - 1) * per_train_round


def test_shuffled_batches_cover_every_sample_once_per_epoch():
    s = RoundBatches(n=10, client_index=1, batch_size=4, epochs=2, seed=0, order="shuffle")
    first = list(s)
    assert [len(b) for b in first] == [4, 4, 2, 4, 4, 2] and len(s) == 6
    assert sorted(sum(first[:3], [])) == list(range(10)) == sorted(sum(first[3:], []))
    s.set_round(1)
    assert list(s) != first
    s.set_round(0)
    assert list(s) == first
    with pytest.raises(Exception, match="batch_order"):
        RoundBatches(10, 0, 4, 1, 0, "sorted")


def test_live_phase_with_workers_extrapolates_and_reports(tiny):
    root, _ = tiny
    m = d.make_manifest(root, test_every=3, domains=("a", "b"))  # 2 clients: fewer worker processes
    bbs = [d.TinyBackbone("tiny")]
    out, res = bench.live_phase(m, d.FolderSource(str(root)), bbs, rounds=10, live_rounds=2, seed=0, setup_s=0.5,
                                cfg=LiveConfig(num_workers=1, fedpcl=CFG, progress=False))
    assert out["live_rounds_measured"] == 2 and out["extrapolated"] is True
    assert out["round_seconds"] == pytest.approx(res.rounds[1].total_s)
    assert out["total_seconds"] == pytest.approx(0.5 + res.rounds[0].total_s + 9 * res.rounds[1].total_s)
    assert 0.0 <= out["accuracy_final"] <= 100.0 and len(out["per_client_final"]) == 2
    cached = {"total_seconds": 2.0, "round_seconds": out["round_seconds"] / 50, "round_train_seconds_median": 1e-3,
              "accuracy_final": 50.0, "history": [{"round": 2, "accuracy": 40.0}]}
    summ = bench.summarise(cached, out)
    assert summ["per_round_ratio"] == pytest.approx(50.0)
    assert summ["end_to_end_ratio"] == pytest.approx(out["total_seconds"] / 2.0)
    assert summ["accuracy"]["cached_at_live_rounds"] == 40.0


def test_same_states_tells_the_commands_run_from_one_stacked_otherwise(tmp_path):
    """The benchmark's check that its in-process run is the command's: the Python API's run
    equals the saved run directory bit for bit; a plain engine call, which stacks clients of
    unequal sizes in the data's order instead of largest first, differs in the last bits (its
    accuracies here are still equal: only the states show it)."""
    import numpy as np

    import fedheads

    rng = np.random.default_rng(0)

    def client(n: int) -> tuple:
        return (rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 3, n),
                rng.normal(size=(4, 8)).astype(np.float32), rng.integers(0, 3, 4))

    data = from_arrays([client(9), client(6), client(12)], 3, ["a", "b", "c"])  # largest first: c, a, b
    kw = {"rounds": 3, "seeds": 0, "device": "cpu", "settings": {"batch_size": 4}}
    fedheads.train(data, "fedpcl", out=tmp_path / "run", **kw)
    saved = tmp_path / "run" / "state" / "seed0.pt"
    assert bench.same_states(saved, fedheads.train(data, "fedpcl", **kw).states[0])
    assert not bench.same_states(saved, run(FedPCL(CFG), data, 3, seed=0))


@pytest.mark.slow  # three subprocesses, each importing torch: ~10 s apiece on a loaded 2-core machine
def test_cached_phase_runs_the_real_commands(tmp_path):
    """partition -> extract (tiny backbones via --plugin) -> fedheads train, timed, plus the
    in-process run, which must be the command's run: the same states bit for bit, history and
    accuracy, with clients of unequal sizes (the engine stacks them largest first)."""
    root = d.make_imagefolder(tmp_path / "img", domains=("a", "b", "c"), per_class=8)
    for k in range(6):  # b/cat keeps 2 images: b trains 8 samples, a and c 9
        (root / "b" / "cat" / f"img_{k}.png").unlink()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    manifest = tmp_path / "m.json"
    assert bench.partition(f"imagefolder:{root}", manifest, train_per_class=3, seed=0, env=env) > 0
    out = bench.cached_phase(manifest, ("tiny", "tiny2"), tmp_path, rounds=3, seed=0, weights_dir=None,
                             plugins=("store_doubles",), env=env)
    assert out["extract_seconds"] > 0 and out["train_command_seconds"] > 0
    assert out["feature_dim"] == 8 and out["n_train"] == [9, 8, 9]
    assert out["states_equal_to_command"] is True
    assert out["accuracy_final"] == out["accuracy_command"]
    command = json.loads((tmp_path / "run" / "results.json").read_text())
    assert out["history"] == [{"round": h["round"], "accuracy": h["accuracy"]} for h in command["history"]]
    assert [h["round"] for h in out["history"]] == [1, 2, 3]
    assert out["round_seconds"] > 0 and out["round_train_seconds_median"] >= 0
