"""The vectorised engine and the per-client loop run the same definition: same accuracies and
states on a tiny federation, for every algorithm (full and partial participation), with the
features padded to the largest client or held in size buckets (fedheads/core/federation.py)."""

from __future__ import annotations

import pytest
import torch
from fed_tiny import tiny_fed
from tolerances import assert_mostly_close

from fedheads.algorithms import create_algorithm, list_algorithms
from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig
from fedheads.algorithms.fedncm import FedNCM
from fedheads.algorithms.fedpcl import FedPCL, FedPCLConfig
from fedheads.algorithms.fedproto import FedProto, FedProtoConfig
from fedheads.algorithms.fedrep import FedRep, FedRepConfig
from fedheads.algorithms.lp import HeadTuning, LPConfig
from fedheads.algorithms.mlp import MLP, MLPConfig
from fedheads.algorithms.perfedavg import PerFedAvg, PerFedAvgConfig
from fedheads.algorithms.pfedme import PFedMe, PFedMeConfig
from fedheads.algorithms.solo import Solo, SoloConfig
from fedheads.core import OptimizerConfig, run, select_participants
from fedheads.core.federation import BucketedFedData, LayoutConfig, to_layout
from fedheads.core.tree import row_range, tree_leaves

SGD = lambda lr: OptimizerConfig("sgd", lr=lr, weight_decay=0.0)  # noqa: E731

# every trained algorithm in tiny configurations that exercise its options (FedNCM, which trains
# nothing, is checked exactly in tests/test_fedncm.py)
ALGOS = {
    "fedavg": lambda: FedAvg(FedAvgConfig(hidden=8, batch_size=4, local_epochs=2)),
    "fedprox-sgd": lambda: FedAvg(FedAvgConfig(hidden=8, batch_size=5, proximal_mu=0.1,
                                               optimizer=OptimizerConfig("sgd", lr=0.05, momentum=0.5))),
    "fedavg-linear": lambda: FedAvg(FedAvgConfig(hidden=0, batch_size=4)),
    "fedpcl": lambda: FedPCL(FedPCLConfig(hidden=8, batch_size=4)),
    "fedpcl-code": lambda: FedPCL(FedPCLConfig(hidden=8, batch_size=4, variant="code")),
    "fedpcl-noise": lambda: FedPCL(FedPCLConfig(hidden=8, batch_size=4, noise="laplace", noise_scale=0.05, noise_p=0.1)),
    "fedpcl-code-noise-bn": lambda: FedPCL(FedPCLConfig(hidden=8, batch_size=5, variant="code", noise="gaussian",
                                                        batch_norm=True, drop_last=False)),
    "fedproto": lambda: FedProto(FedProtoConfig(hidden=8, batch_size=4)),
    "fedproto-mean": lambda: FedProto(FedProtoConfig(hidden=8, batch_size=4, aggregation="mean")),
    "solo": lambda: Solo(SoloConfig(hidden=8, batch_size=4)),
    "fedrep": lambda: FedRep(FedRepConfig(hidden=8, batch_size=4, head_epochs=2)),
    "pfedme": lambda: PFedMe(PFedMeConfig(hidden=8, batch_size=5, K=2, lr=0.05)),
    "perfedavg": lambda: PerFedAvg(PerFedAvgConfig(hidden=8, batch_size=4, alpha=0.05)),
    "lp": lambda: HeadTuning(LPConfig(batch_size=4, optimizer=SGD(0.1))),
    "lp-fedprox-ncm": lambda: HeadTuning(LPConfig(batch_size=4, init="fedncm", server_opt="fedprox", prox_mu=0.1)),
    "lp-fedadam": lambda: HeadTuning(LPConfig(batch_size=4, server_opt="fedadam", server_lr=0.01, optimizer=SGD(0.1))),
    "lp-fedadam-reddi": lambda: HeadTuning(LPConfig(batch_size=4, server_opt="fedadam", server_lr=0.01,
                                                    adam_flavour="reddi", optimizer=SGD(0.1))),
    "mlp-ncm-adam": lambda: MLP(MLPConfig(hidden=(8, 8), batch_size=4, init="fedncm", server_opt="fedadam")),
    "lp-fed3r": lambda: HeadTuning(LPConfig(batch_size=4, init="fed3r", optimizer=SGD(0.1))),
    "lp-no-local": lambda: HeadTuning(LPConfig(batch_size=4, optimizer=SGD(0.1), local_models=False)),
    "lp-no-local-carry": lambda: HeadTuning(LPConfig(batch_size=4, local_models=False, reset_optimizer=False,
                                                     optimizer=OptimizerConfig("sgd", lr=0.05, momentum=0.5))),
    "mlp-fedcof": lambda: MLP(MLPConfig(hidden=(8, 8), batch_size=4, init="fedcof")),
    "fedavg-no-local": lambda: FedAvg(FedAvgConfig(hidden=8, batch_size=4, local_models=False)),
    "fedavg-no-local-carry": lambda: FedAvg(FedAvgConfig(hidden=8, batch_size=4, local_models=False,
                                                         reset_optimizer=False)),
}


# buckets of at most 2 clients of similar size: with tiny_fed(M=6)'s sizes they interleave the
# client order, so messages and states must be put back in order across buckets
BUCKETS = LayoutConfig("bucketed", waste=1.0, bucket_clients=2)


def bucketed_fed() -> BucketedFedData:
    data = to_layout(tiny_fed(M=6), BUCKETS)
    assert isinstance(data, BucketedFedData) and len(data.buckets) == 3
    assert [i for ms in data.members for i in ms] != list(range(6))  # not in client order
    return data


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(ALGOS))
def test_vectorized_equals_loop(name: str, fraction: float) -> None:
    _assert_engines_agree(ALGOS[name], tiny_fed(), tiny_fed(), fraction)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted({**ALGOS, "fedncm": FedNCM}))
def test_bucketed_equals_loop(name: str, fraction: float) -> None:
    """Each bucket is one vectorised call; the loop runs the padded data one client at a time."""
    _assert_engines_agree({**ALGOS, "fedncm": FedNCM}[name], bucketed_fed(), tiny_fed(M=6), fraction,
                          trains=name != "fedncm")


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted({**ALGOS, "fedncm": FedNCM}))
def test_bucketed_largest_first_equals_loop(name: str, fraction: float) -> None:
    """Clients stored largest first (as `fedheads train` loads them): every bucket's rows of the
    state are consecutive, so the engine hands client_update views of them and writes the result
    back in place (core/tree.py tree_rows / tree_put_rows_); the run is still the loop's."""
    ordered = tiny_fed(M=6).by_size()[0]
    data = to_layout(ordered, BUCKETS)
    assert isinstance(data, BucketedFedData) and len(data.buckets) == 3
    assert all(row_range(ms) is not None for ms in data.members)
    _assert_engines_agree({**ALGOS, "fedncm": FedNCM}[name], data, ordered, fraction, trains=name != "fedncm")


# registered algorithms that ALGOS (tiny configurations) and the FedNCM tests above do not cover
UNCOVERED = sorted({i.name for i in list_algorithms()} - {make().name for make in ALGOS.values()} - {"fedncm"})


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", UNCOVERED)
def test_every_registered_algorithm_agrees_across_engines(name: str, fraction: float) -> None:
    """Registry-wide: every registered algorithm ALGOS does not list runs, in its default
    configuration, on the vectorised engine (padded, and bucketed largest first) as on the loop;
    an algorithm file added to the registry is covered without editing this test."""
    make = lambda: create_algorithm(name)  # noqa: E731
    _assert_engines_agree(make, tiny_fed(M=6), tiny_fed(M=6), fraction, trains=None)
    ordered = tiny_fed(M=6).by_size()[0]
    _assert_engines_agree(make, to_layout(ordered, BUCKETS), ordered, fraction, trains=None)


def _assert_engines_agree(make, data, loop_data, fraction: float, trains: bool | None = True) -> None:
    a = run(make(), data, rounds=3, seed=3, fraction=fraction, engine="vectorized", progress=False)
    b = run(make(), loop_data, rounds=3, seed=3, fraction=fraction, engine="loop", progress=False)
    for ra, rb in zip(a.history, b.history):
        assert ra.participants == rb.participants
        assert ra.comm == rb.comm
        for k in ra.accuracy:
            torch.testing.assert_close(ra.accuracy[k], rb.accuracy[k], equal_nan=True)
    for sa, sb in ((a.client_state, b.client_state), (a.server_state, b.server_state)):
        for ta, tb in zip(tree_leaves(sa), tree_leaves(sb)):
            # float32 reductions differ between M=1 and stacked bmm; Adam amplifies ~1e-7 to ~1e-5
            torch.testing.assert_close(ta, tb, atol=5e-5, rtol=1e-3)
    assert a.trainable_params_per_client == b.trainable_params_per_client
    assert trains is None or (a.trainable_params_per_client > 0) == trains


def test_bucketed_fedncm_is_exact() -> None:
    """FedNCM's float64 sums reach the server in client order from every bucket: the means equal
    the padded layout's bit for bit."""
    a = run(FedNCM(), bucketed_fed(), rounds=1, progress=False)
    b = run(FedNCM(), tiny_fed(M=6), rounds=1, progress=False)
    assert torch.equal(a.server_state.means, b.server_state.means)
    for k in a.history[0].accuracy:
        assert torch.equal(a.history[0].accuracy[k], b.history[0].accuracy[k])


def test_loop_on_buckets_equals_loop_on_padded() -> None:
    """The loop takes one client at a time out of its bucket: the same rows, the same run."""
    make = ALGOS["fedpcl"]
    a = run(make(), bucketed_fed(), rounds=2, seed=1, fraction=0.5, engine="loop", progress=False)
    b = run(make(), tiny_fed(M=6), rounds=2, seed=1, fraction=0.5, engine="loop", progress=False)
    for ta, tb in zip(tree_leaves((a.client_state, a.server_state)), tree_leaves((b.client_state, b.server_state))):
        assert torch.equal(ta, tb)


def test_training_changes_state_and_learns() -> None:
    data = tiny_fed(M=3, seed=1)
    cfg = FedAvgConfig(hidden=8, batch_size=8, local_epochs=2, optimizer=OptimizerConfig(lr=0.03))
    res = run(FedAvg(cfg), data, rounds=5, seed=0, progress=False)
    acc = res.final_accuracy()
    assert float(acc.mean()) > 0.7  # separated clusters: chance is 1/3
    assert res.history[0].comm.up_values == 3 * res.upload_values_per_client


def test_participant_selection_is_seeded() -> None:
    a = select_participants(10, 0.3, seed=1, round_=4)
    assert a.tolist() == select_participants(10, 0.3, seed=1, round_=4).tolist()
    assert len(a) == 3 and a.tolist() == sorted(a.tolist())
    assert select_participants(10, 1.0, 1, 0).tolist() == list(range(10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(ALGOS))
def test_cuda_engines_agree_and_match_cpu(name: str) -> None:
    """On CUDA both engines agree as on the CPU (half the clients per round: the in-place
    optimisers' active-client row runs), and the vectorised run on CUDA ends where the CPU's does."""
    from fedheads.core.engine import to_device

    _assert_engines_agree(ALGOS[name], to_device(tiny_fed(), "cuda"), to_device(tiny_fed(), "cuda"), 0.5)
    a = run(ALGOS[name](), tiny_fed(), rounds=3, seed=1, fraction=0.5, progress=False)
    b = run(ALGOS[name](), to_device(tiny_fed(), "cuda"), rounds=3, seed=1, fraction=0.5, progress=False)
    la, lb = tree_leaves((a.client_state, a.server_state)), tree_leaves((b.client_state, b.server_state))
    assert len(la) == len(lb) and all(tb.device.type == "cuda" for tb in lb)
    for i, (ta, tb) in enumerate(zip(la, lb)):
        assert_mostly_close(ta, tb.cpu(), loose=1e-2, name=f"leaf {i}", share=0.0)  # ten Adam steps of lr 1e-3
    # the share of elements that drift is counted over the whole state: a leaf of 24 elements (FedPCL's
    # global prototypes) had 3 apart on an H200, Adam's sign flips of near-zero gradients carried into
    # the means; a device bug (a wrong row, a lost mask) moves whole client rows (tests/tolerances.py)
    flat = lambda ls: torch.cat([t.cpu().reshape(-1) for t in ls if t.is_floating_point()])  # noqa: E731
    assert_mostly_close(flat(la), flat(lb), loose=1e-2, name="whole state")
    for k in a.history[-1].accuracy:  # 8 test samples per client: one sample is 0.125
        diff = (a.history[-1].accuracy[k] - b.history[-1].accuracy[k].cpu()).abs().nan_to_num(0.0)
        assert float(diff.max()) <= 0.125 + 1e-6, k


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_evaluating_changes_nothing(name: str) -> None:
    """The final accuracies and states do not depend on how often the model is evaluated
    (pipelines' paper scale evaluates every 10 rounds: its tables read the last round)."""
    data = tiny_fed()
    every = run(ALGOS[name](), data, rounds=4, seed=3, fraction=0.5, eval_every=1, progress=False)
    last = run(ALGOS[name](), data, rounds=4, seed=3, fraction=0.5, eval_every=3, progress=False)
    evaluated = lambda r: [h.round for h in r.history if h.accuracy is not None]  # noqa: E731
    assert evaluated(every) == [0, 1, 2, 3] and evaluated(last) == [2, 3]
    for k in every.history[-1].accuracy:
        assert torch.equal(every.history[-1].accuracy[k], last.history[-1].accuracy[k]), k
    for ta, tb in zip(tree_leaves(every.client_state), tree_leaves(last.client_state)):
        assert torch.equal(ta, tb)
