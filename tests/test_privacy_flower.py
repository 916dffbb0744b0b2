"""Differential privacy under Flower's simulation runtime (in process): the private wrapper
composes with SecAgg+ without touching fedheads.flower. Distributed noise is each node's share
(keyed by the run's seed, the round and the node's global client id), so the secure sum carries
the same noise as the engine's; central noise is the server's, added to the secure totals."""

from __future__ import annotations

import pytest
import torch
from flower_helpers import FLOWER_MISSING  # noqa: E402

pytest.importorskip("flwr", reason=FLOWER_MISSING)

from flower_helpers import write_store  # noqa: E402

import fedheads.algorithms as registry  # noqa: E402
from fedheads.core.engine import run  # noqa: E402
from fedheads.flower import loop, node  # noqa: E402
from fedheads.flower.server import FlowerRunConfig  # noqa: E402
from fedheads.flower.sim import simulate_store  # noqa: E402
from fedheads.privacy import Mechanism, Private  # noqa: E402
from fedheads.run.load import load_fed_data  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("dpfl"))


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_secagg_carries_the_same_noise_as_the_engine(store, monkeypatch, mode):
    mech = Mechanism(noise_multiplier=0.5, clip=3.0, mode=mode, noise_seed=11)
    plain = registry.create_algorithm
    # the server's algorithm and every node's are the private FedNCM (no flower code changes)
    monkeypatch.setattr(registry, "create_algorithm", lambda name, **kw: Private(plain(name, **kw), mech))
    monkeypatch.setattr(loop, "build", lambda cfg: (Private(plain("fedncm"), mech), {}))
    monkeypatch.setattr(node, "_CACHE", {})
    out = simulate_store(FlowerRunConfig(algorithm="fedncm", backbones="synth", rounds=1, timeout=120, secagg=True,
                                         seed=2), store)
    ref = run(Private(plain("fedncm"), mech), load_fed_data(store, ["synth"], "cpu"), 1, seed=2,
              progress=False).server_state
    quiet = Mechanism(noise_multiplier=1e-12, clip=3.0, mode=mode, noise_seed=11)  # clipped, no noise
    clipped = run(Private(plain("fedncm"), quiet), load_fed_data(store, ["synth"], "cpu"), 1, seed=2,
                  progress=False).server_state
    ss = out["server_state"]
    assert torch.equal(ss.counts, ref.counts)
    assert (ss.sums - ref.sums).abs().max().item() < 1e-3  # SecAgg+'s quantisation only
    assert (ss.sums - clipped.sums).abs().max().item() > 0.1  # and the noise is there
    assert out["result"].engine == "flower-secagg"
