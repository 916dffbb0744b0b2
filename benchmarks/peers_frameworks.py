"""One FedAvg run of a benchmark case in one framework, in a fresh interpreter (bench_peers.py
starts one per framework and repeat, and reads its resource usage with os.wait4).

    python benchmarks/peers_frameworks.py CASE_DIR FRAMEWORK OUT.npz

CASE_DIR holds case.npz (x_train [N, D] with clients' rows consecutive, pre-shuffled,
offsets [M+1], the per-round client lists `schedule` [R, k] and the initial head in fedheads'
naming, `init/<name>`) and case.json (classes, hidden, lr, batch, epochs, threads, the rounds
after which the global model is kept). Every framework runs the same algorithm: FedAvg
(McMahan et al., AISTATS 2017, Algorithm 1) with plain client SGD (no momentum, no weight
decay), one fresh optimiser per client and round, the mean cross-entropy of each mini-batch,
aggregation weighted by the clients' sample counts, the same initial weights and the same
clients in every round. The peers iterate each client's rows in the stored order (pfl-research
does not shuffle; the DataLoaders of Flower and FedLab are told not to), so their models agree
to float rounding; fedheads shuffles with its own counter-based keys.

Timed: from the features in memory (numpy) to the last round's global model, the framework's
own setup included (fedheads' stacking, pfl's datasets, Flower's nodes). Not timed: imports,
reading case.npz, writing the kept models. Prints one line `RESULT {json}` (with the process's
peak resident memory, VmHWM)."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FRAMEWORKS = ("fedheads", "fedheads-loop", "pfl", "flower", "fedlab")
_OURS = ("fedheads.algorithms.fedavg", "fedheads.core.engine", "fedheads.core.optim", "fedheads.run.load")
IMPORTS = {  # imported before the clock starts (the run functions import them again, from the cache)
    "fedheads": _OURS, "fedheads-loop": _OURS,
    "pfl": ("pfl.aggregate.simulate", "pfl.aggregate.weighting", "pfl.algorithm", "pfl.callback.base", "pfl.data.dataset",
            "pfl.data.federated_dataset", "pfl.hyperparam", "pfl.metrics", "pfl.model.pytorch"),
    "flower": ("flwr.app", "flwr.clientapp", "flwr.serverapp.strategy", "fedheads.flower.sim", "torch.utils.data"),
    "fedlab": ("fedlab.contrib.algorithm.basic_client", "fedlab.contrib.algorithm.basic_server", "fedlab.utils.aggregator",
               "fedlab.utils.serialization", "torch.utils.data"),
}


class Head(nn.Sequential):
    """The head every peer trains: Linear(D, C), or Linear(D, H) -> ReLU -> Linear(H, C);
    `loss` and `metrics` are the methods pfl-research's PyTorchModel calls."""

    def __init__(self, dim: int, hidden: int, classes: int) -> None:
        layers = [nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes)] if hidden else [nn.Linear(dim, classes)]
        super().__init__(*layers)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:  # noqa: A002 (pfl's name)
        self.train(not eval)
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:  # noqa: A002
        from pfl.metrics import Weighted

        self.train(not eval)
        logits = self(x)
        return {"loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), len(y)),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), len(y))}


def to_torch(params: dict[str, np.ndarray], hidden: int) -> dict[str, torch.Tensor]:
    """fedheads' head parameters (weights [Din, Dout]) as Head's state_dict (weights [Dout, Din])."""
    names = {"proj": "0", "cls": "2"} if hidden else {"cls": "0"}
    return {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": torch.as_tensor(v.T.copy() if v.ndim == 2 else v.copy())
            for k, v in params.items()}


def from_torch(state: dict[str, torch.Tensor], hidden: int) -> dict[str, np.ndarray]:
    """The inverse of to_torch."""
    names = {"0": "proj", "2": "cls"} if hidden else {"0": "cls"}
    return {f"{names[k.split('.')[0]]}.{k.split('.')[1]}": (v.detach().numpy().T if v.ndim == 2 else v.detach().numpy()).copy()
            for k, v in state.items()}


class Case:
    """A benchmark case as the child reads it."""

    def __init__(self, path: Path) -> None:
        z = np.load(path / "case.npz")
        self.x, self.y, self.offsets = z["x_train"], z["y_train"], z["offsets"]
        self.schedule = z["schedule"]
        self.init = {k[len("init/"):]: z[k] for k in z.files if k.startswith("init/")}
        cfg = json.loads((path / "case.json").read_text())
        self.classes, self.hidden, self.lr = int(cfg["classes"]), int(cfg["hidden"]), float(cfg["lr"])
        self.batch, self.epochs, self.seed = int(cfg["batch"]), int(cfg["epochs"]), int(cfg["seed"])
        self.keep = set(int(r) for r in cfg["keep_rounds"])
        self.dim, self.rounds, self.num_clients = self.x.shape[1], self.schedule.shape[0], len(self.offsets) - 1
        self.kept: dict[int, dict[str, np.ndarray]] = {}

    def rows(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def model(self) -> Head:
        m = Head(self.dim, self.hidden, self.classes)
        m.load_state_dict(to_torch(self.init, self.hidden))
        return m

    def keep_torch(self, round_: int, state: dict[str, torch.Tensor]) -> None:
        if round_ in self.keep:
            self.kept[round_] = from_torch(state, self.hidden)


def run_fedheads(case: Case, engine: str) -> list[float]:
    """fedheads' FedAvg on a linear or MLP head (no BatchNorm, no L2 normalisation), either engine.
    No client keeps its local model between rounds (local_models=False): no peer does, and the
    global model is the same bit for bit (fedheads' default keeps one per client for its
    "local_model" evaluation rule, a head per client of the federation)."""
    from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig
    from fedheads.core.engine import run
    from fedheads.core.optim import OptimizerConfig
    from fedheads.run.load import from_arrays

    empty = (case.x[:0], case.y[:0])  # nothing to test per client: the harness tests the kept models
    data = from_arrays([(case.x[case.rows(i)], case.y[case.rows(i)], *empty) for i in range(case.num_clients)],
                               case.classes, layout="auto")
    cfg = FedAvgConfig(hidden=case.hidden, batch_norm=False, normalize=False, batch_size=case.batch,
                       local_epochs=case.epochs, optimizer=OptimizerConfig("sgd", lr=case.lr, weight_decay=0.0),
                       local_models=False)

    class Keep:  # engine.Checkpointer: never resumes, keeps the global head after the chosen rounds
        def load(self, init):  # noqa: ANN001, ANN202
            return None

        def save(self, state):  # noqa: ANN001, ANN202
            if state.round in case.keep:
                case.kept[state.round] = {k: v.detach().numpy().copy() for k, v in state.server_state.params.items()}

    k = case.schedule.shape[1]
    res = run(FedAvg(cfg), data, case.rounds, case.seed, fraction=k / case.num_clients, engine=engine, eval_every=0,
              progress=False, checkpoint=Keep())
    return [r.seconds for r in res.history]  # each round's training (updates + aggregation), evaluation apart


def run_pfl(case: Case) -> None:
    """pfl-research's FederatedAveraging on its SimulatedBackend (PyTorch), as its tutorials set
    it up: central SGD with learning rate 1 applies the averaged model difference; the updates
    are weighted by the clients' datapoints (WeightByDatapoints); the user sampler hands out the
    schedule's clients in order."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    x, y = torch.from_numpy(case.x), torch.from_numpy(case.y)
    order = iter(case.schedule.reshape(-1).tolist())
    train = FederatedDataset(lambda uid: Dataset((x[case.rows(uid)], y[case.rows(uid)]), user_id=uid), lambda: next(order))
    val = FederatedDataset(lambda uid: Dataset((x[:1], y[:1]), user_id=uid), lambda: 0)  # never sampled (no cohort)
    net = case.model()
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))

    class Keep(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # noqa: ANN001, ANN201
            case.keep_torch(central_iteration + 1, model.pytorch_model.state_dict())
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=case.rounds, evaluation_frequency=case.rounds + 1,
                                           train_cohort_size=case.schedule.shape[1], val_cohort_size=0),
        backend=SimulatedBackend(training_data=train, val_data=val, postprocessors=[WeightByDatapoints()]),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=case.lr, local_num_epochs=case.epochs,
                                              local_batch_size=case.batch),
        model_eval_params=NNEvalHyperParams(local_batch_size=1024), callbacks=[Keep()], send_metrics_to_platform=False)


def run_flower(case: Case) -> None:
    """Flower's FedAvg strategy (flwr.serverapp.strategy) driving a ClientApp written as
    Flower's PyTorch quickstart writes it (load the arrays, a DataLoader of the client's rows,
    SGD, reply with the arrays and "num-examples"), one virtual SuperNode per client, in Flower's
    simulation engine (vce_api, InMemoryGrid) with fedheads' in-process backend (Flower 1.41's
    run_simulation needs Ray). The strategy's node sampling is replaced by the schedule: each
    train message names the client (partition) the node trains, in its config."""
    import random

    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp.strategy import FedAvg
    from torch.utils.data import DataLoader, TensorDataset

    from fedheads.flower.sim import simulate  # sets Flower's telemetry / update-check variables off

    logging.getLogger("flwr").setLevel(logging.WARNING)  # no per-round console lines (output is not the work)

    x, y = torch.from_numpy(case.x), torch.from_numpy(case.y)
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:  # noqa: ANN001
        model = Head(case.dim, case.hidden, case.classes)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        rows = case.rows(int(msg.content["config"]["partition-id"]))
        loader = DataLoader(TensorDataset(x[rows], y[rows]), batch_size=case.batch, shuffle=False)
        opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        model.train()
        total = 0.0
        for _ in range(case.epochs):
            for xb, yb in loader:
                opt.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                opt.step()
                total += loss.item()
        metrics = MetricRecord({"train_loss": total / max(1, len(loader)), "num-examples": len(loader.dataset)})
        return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)

    class ScheduledFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
            clients = case.schedule[server_round - 1].tolist()
            nodes = random.sample(list(grid.get_node_ids()), len(clients))
            return [Message(content=RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: ConfigRecord(
                {**dict(config), "server-round": server_round, "partition-id": int(c)})}),
                message_type=MessageType.TRAIN, dst_node_id=node) for node, c in zip(nodes, clients)]

    def main(grid, context) -> None:  # noqa: ANN001  (a ServerApp main)
        strategy = ScheduledFedAvg(fraction_train=case.schedule.shape[1] / case.num_clients, fraction_evaluate=0.0,
                                   min_available_nodes=case.num_clients)

        def keep(server_round: int, arrays: ArrayRecord) -> None:  # evaluate_fn: called after every round
            if server_round in case.keep:
                case.keep_torch(server_round, arrays.to_torch_state_dict())

        strategy.start(grid=grid, initial_arrays=ArrayRecord(case.model().state_dict()), num_rounds=case.rounds,
                       train_config=ConfigRecord({"lr": case.lr}), evaluate_fn=keep)

    simulate(main, [{"partition-id": i, "num-partitions": case.num_clients} for i in range(case.num_clients)], {}, app)


def run_fedlab(case: Case) -> None:
    """FedLab's standalone loop (its StandalonePipeline's main loop) with SGDSerialClientTrainer
    and SyncServerHandler. FedLab's FedAvg averages uniformly; the clients here also upload their
    sample count and the server weights by it (FedLab's documented extension point,
    global_update), and the server's sample_clients returns the schedule's clients."""
    from fedlab.contrib.algorithm.basic_client import SGDSerialClientTrainer
    from fedlab.contrib.algorithm.basic_server import SyncServerHandler
    from fedlab.utils.aggregator import Aggregators
    from fedlab.utils.serialization import SerializationTool
    from torch.utils.data import DataLoader, TensorDataset

    x, y = torch.from_numpy(case.x), torch.from_numpy(case.y)

    class Clients:  # a FedLab FedDataset: one DataLoader per client id
        def get_dataloader(self, id: int, batch_size: int, type: str = "train") -> DataLoader:  # noqa: A002
            rows = case.rows(id)
            return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=batch_size, shuffle=False)

    class Trainer(SGDSerialClientTrainer):
        def train(self, model_parameters, train_loader):  # noqa: ANN001, ANN201
            return super().train(model_parameters, train_loader) + [torch.tensor(float(len(train_loader.dataset)))]

    class Handler(SyncServerHandler):
        @property
        def num_clients_per_round(self) -> int:
            return case.schedule.shape[1]

        def sample_clients(self) -> list[int]:
            return case.schedule[self.round].tolist()

        def global_update(self, buffer):  # noqa: ANN001, ANN201
            weights = torch.stack([b[1] for b in buffer])
            SerializationTool.deserialize_model(self._model, Aggregators.fedavg_aggregate([b[0] for b in buffer], weights))

    handler = Handler(case.model(), global_round=case.rounds, sample_ratio=case.schedule.shape[1] / case.num_clients)
    trainer = Trainer(case.model(), case.num_clients)
    trainer.setup_dataset(Clients())
    trainer.setup_optim(case.epochs, case.batch, case.lr)
    handler.num_clients = trainer.num_clients
    while not handler.if_stop:  # fedlab.core.standalone.StandalonePipeline.main
        sampled = handler.sample_clients()
        trainer.local_process(handler.downlink_package, sampled)
        for pack in trainer.uplink_package:
            handler.load(pack)
        case.keep_torch(handler.round, handler.model.state_dict())


def main(case_dir: str, framework: str, out: str) -> None:
    case = Case(Path(case_dir))
    torch.set_num_threads(int(json.loads((Path(case_dir) / "case.json").read_text())["threads"]))
    torch.manual_seed(case.seed)
    import random

    random.seed(case.seed)
    for module in IMPORTS[framework]:
        importlib.import_module(module)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # its first use imports torch._dynamo (seconds)
    t0, c0 = time.perf_counter(), time.process_time()
    extra = {}
    if framework in ("fedheads", "fedheads-loop"):
        extra["round_seconds"] = run_fedheads(case, "vectorized" if framework == "fedheads" else "loop")
    else:
        {"pfl": run_pfl, "flower": run_flower, "fedlab": run_fedlab}[framework](case)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    with open("/proc/self/status") as f:  # this interpreter's peak (ru_maxrss would include the parent's before exec)
        peak = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM")), 0)
    np.savez(out, **{f"{r}/{k}": v for r, p in case.kept.items() for k, v in p.items()})
    print("RESULT " + json.dumps({"wall_seconds": wall, "cpu_seconds": cpu, "rounds": case.rounds, "peak_rss_bytes": peak,
                                  "kept_rounds": sorted(case.kept), **extra}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[2] not in FRAMEWORKS:
        raise SystemExit(f"usage: peers_frameworks.py CASE_DIR {{{','.join(FRAMEWORKS)}}} OUT.npz")
    main(*sys.argv[1:])
