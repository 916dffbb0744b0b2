"""FedAvg: the server step by hand, communication sizes, FedProx term and the registry."""

from __future__ import annotations

import torch
from fed_tiny import tiny_fed

from fedheads.algorithms import create_algorithm, list_algorithms
from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig, FedAvgMessage, FedAvgServerState
from fedheads.core import RoundCtx, ServerSGD, payload_size


def test_server_weighted_average_by_hand() -> None:
    alg = FedAvg(FedAvgConfig(hidden=0))
    ss = FedAvgServerState({"w": torch.tensor([1.0, 1.0])}, {}, {})
    msg = FedAvgMessage({"w": torch.tensor([[2.0, 0.0], [-1.0, 3.0]])}, {}, torch.tensor([1.0, 3.0]))
    ctx = RoundCtx(0, 0, torch.tensor([0, 1]), 2)
    new, bc = alg.server_aggregate(ss, msg, ctx)
    # Delta = (1*[2,0] + 3*[-1,3]) / 4 = [-0.25, 2.25]
    torch.testing.assert_close(new.params["w"], torch.tensor([0.75, 3.25]))
    torch.testing.assert_close(bc.params["w"], new.params["w"])
    half = FedAvg(FedAvgConfig(hidden=0), server_opt=ServerSGD(lr=0.5))
    torch.testing.assert_close(half.server_aggregate(ss, msg, ctx)[0].params["w"], torch.tensor([0.875, 2.125]))


def test_comm_sizes_count_actual_tensors() -> None:
    data = tiny_fed()
    alg = FedAvg(FedAvgConfig(hidden=0))
    init = alg.init(data.spec(), 0)
    D, C = data.dim, data.num_classes
    assert alg.trainable_params(init.client_state) == D * C + C
    _, msg = alg.client_update(init.client_state, init.broadcast, data, RoundCtx(0, 0, torch.arange(4), 4))
    vals, nbytes = payload_size(msg)
    assert vals == D * C + C + 1 and nbytes == 4 * vals  # delta + weight, float32
    assert payload_size(init.broadcast, per_client=False) == (D * C + C, 4 * (D * C + C))


def test_all_clients_start_from_global_model_and_prox_pulls_back() -> None:
    data = tiny_fed()
    ctx = RoundCtx(0, 0, torch.arange(4), 4)
    far = {}
    for mu in (0.0, 10.0):
        alg = FedAvg(FedAvgConfig(hidden=8, proximal_mu=mu, local_epochs=3, batch_size=4))
        init = alg.init(data.spec(), 0)
        p0 = init.client_state.params["proj.weight"]
        assert torch.equal(p0[0], p0[3])
        _, msg = alg.client_update(init.client_state, init.broadcast, data, ctx)
        far[mu] = sum(float(v.norm()) for v in msg.delta.values())
    assert far[10.0] < far[0.0]


def test_registry_builds_fedavg() -> None:
    names = {i.name for i in list_algorithms()}
    assert {"fedavg", "fedavg-linear"} <= names
    alg = create_algorithm("fedavg", lr=0.01, batch_size=8)
    assert alg.cfg.optimizer.lr == 0.01 and alg.cfg.batch_size == 8
