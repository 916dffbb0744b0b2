"""Flower's simulation runtime in this process, for development and the equality tests.

The same pieces `flwr.simulation.run_simulation` wires up (an in-memory LinkState, the
InMemoryGrid the ServerApp talks to, the simulation runtime's message workers and per-node
Context stores), with one difference: Flower 1.41 hard-codes a Ray backend, far too heavy for
small heads on cached features (and it starts services), so the ClientApps run here, one message
at a time, through `InProcessBackend`, a subclass of Flower's own `Backend` interface. Each
virtual node gets its own node config (its store and client), exactly as a SuperNode would."""

from __future__ import annotations

import contextlib
import copy
import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from embedcache.errors import UserError
from fedheads.flower import require_flower

require_flower()

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.clientapp.client_app import ClientAppException  # noqa: E402
from flwr.common.constant import SUPERLINK_NODE_ID  # noqa: E402
from flwr.compat.client.run_info_store import DeprecatedRunInfoStore  # noqa: E402
from flwr.proto.task_pb2 import Task  # noqa: E402  pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api  # noqa: E402
from flwr.server.superlink.fleet.vce.backend import Backend  # noqa: E402
from flwr.server.superlink.fleet.vce.metrics import VceMetrics  # noqa: E402
from flwr.server.superlink.linkstate import LinkStateFactory  # noqa: E402
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord  # noqa: E402
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID  # noqa: E402
from flwr.supercore.object_store import ObjectStoreFactory  # noqa: E402
from flwr.supercore.run import Run  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from flwr.superlink.federation import NoOpFederationManager  # noqa: E402
from flwr.superlink.grid import InMemoryGrid  # noqa: E402


class InProcessBackend(Backend):
    """Runs the ClientApp in the calling worker thread (one worker: messages in order)."""

    def __init__(self, backend_config: dict | None = None) -> None:
        super().__init__(backend_config or {})
        self.app_fn: Callable[[], ClientApp] | None = None

    def build(self, app_fn: Callable[[], ClientApp]) -> None:
        self.app_fn = app_fn

    @property
    def num_workers(self) -> int:
        return 1

    def is_worker_idle(self) -> bool:
        return True

    def terminate(self) -> None:
        self.app_fn = None

    def process_message(self, message: Message, context: Context) -> tuple[Message, Context]:
        assert self.app_fn is not None, "build() first"
        # a private copy, as a node gets over the network: Flower's workflows reuse one record
        # object for the messages of all nodes (and secaggplus_mod pops from it)
        message = _private_copy(message)
        try:
            return self.app_fn()(message=message, context=context), context
        except Exception as ex:  # reported to the server as the node's error reply, as Flower does
            raise ClientAppException(f"{type(ex).__name__}: {ex}") from ex


def _private_copy(message: Message) -> Message:
    """The message with its own records (config values copied; arrays are never mutated)."""
    out = copy.copy(message)
    out.__dict__ = dict(message.__dict__)
    if message.has_content():
        c = message.content
        out.__dict__["_content"] = RecordDict(
            {**{k: ArrayRecord(dict(v)) for k, v in c.array_records.items()},
             **{k: ConfigRecord(copy.deepcopy(dict(v))) for k, v in c.config_records.items()},
             **{k: MetricRecord(dict(v)) for k, v in c.metric_records.items()}})
    return out


def simulate(main: Callable[[Any, Context], Any], node_configs: list[dict[str, Any]], run_config: dict[str, Any],
             client_app: ClientApp | None = None) -> Any:
    """Run `main(grid, context)` (a ServerApp main) against one virtual SuperNode per entry of
    `node_configs`; returns what `main` returned (exceptions are re-raised here)."""
    if client_app is None:
        from fedheads.flower.node import app as client_app
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    run_id, task_id = secrets.randbits(63), secrets.randbits(63)
    run = Run.create_empty(run_id=run_id)
    run.primary_task_id, run.federation_id = task_id, NOOP_FEDERATION_ID
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    state = factory.state()
    state.run_ids[run_id] = RunRecord(run=run)  # type: ignore[attr-defined]
    state.task_store[task_id] = Task(task_id=task_id, run_id=run_id)  # type: ignore[attr-defined]
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    mapping = vce_api._register_nodes(num_nodes=len(node_configs), state_factory=factory)  # noqa: SLF001
    stores: dict[int, DeprecatedRunInfoStore] = {}
    for (node_id, i) in mapping.items():
        stores[node_id] = DeprecatedRunInfoStore(node_id=node_id, node_config=dict(node_configs[i]))
        stores[node_id].register_context(run_id=run_id, run=run, app_dir=None)
    f_stop = threading.Event()
    outcome: dict[str, Any] = {}
    context = Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=dict(run_config))

    def serve() -> None:
        try:
            outcome["value"] = main(grid, context)
        except BaseException as ex:  # noqa: BLE001  re-raised in the caller's thread
            outcome["error"] = ex
        finally:
            f_stop.set()

    server = threading.Thread(target=serve, name="fedheads-serverapp", daemon=True)
    server.start()
    vce_api.run_api(lambda: client_app, lambda: InProcessBackend(), mapping, factory, stores, f_stop, VceMetrics())
    server.join()
    if "error" in outcome:
        raise outcome["error"]
    if "value" not in outcome:
        raise UserError("flower simulation: the server stopped without a result")
    return outcome["value"]


class _RoundLines(logging.Handler):
    """Passes the round loop's one line per round (fedheads.flower, "round r/R: ...") to `echo`."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.echo = echo

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.levelno == logging.INFO and msg.startswith("round "):
            self.echo(msg)


@contextlib.contextmanager
def flower_logs(path: Path, echo: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, Flower's own log lines (the "flwr" logger) and fedheads.flower's go
    to the file `path`, not the console; `echo` gets one line per round."""
    flwr_logger, own = logging.getLogger("flwr"), logging.getLogger("fedheads.flower")
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, mode="w", encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    to_file.setLevel(logging.INFO)  # what Flower's console handler shows
    saved, level, propagate = list(flwr_logger.handlers), own.level, own.propagate
    rounds = _RoundLines(echo)
    for h in saved:
        flwr_logger.removeHandler(h)
    flwr_logger.addHandler(to_file)
    own.addHandler(to_file)
    own.addHandler(rounds)
    own.setLevel(logging.INFO)
    own.propagate = False
    try:
        yield
    finally:
        flwr_logger.removeHandler(to_file)
        for h in saved:
            flwr_logger.addHandler(h)
        own.removeHandler(to_file)
        own.removeHandler(rounds)
        own.setLevel(level)
        own.propagate = propagate
        to_file.close()


def simulate_store(cfg: Any, store: str, clients: list[str] | None = None, client_app: ClientApp | None = None,
                   noise_seed: int | None = None) -> Any:
    """One virtual node per client of `store` (each loads only its own client): the simulation
    of `fedheads train` on the same store. `noise_seed` (runs under DP, cfg.dp_*): reproducible
    noise, the key given to the server and, in its node config, to every virtual node, so that the
    run equals the engine's Private run (a deployment has none: each party draws its own secret)."""
    from embedcache.store.reader import open_store
    from fedheads.flower.server import run_federation

    have = list(open_store(store).clients)
    names = list(clients) if clients else have
    unknown = [c for c in names if c not in have]
    if unknown:  # before any virtual node starts: one line naming them
        raise UserError(f"clients {','.join(names)}: {', '.join(unknown)} not in {store} (has {', '.join(have)})")
    seed = {} if noise_seed is None else {"dp-noise-seed": int(noise_seed)}
    nodes = [{"store": str(store), "client": c, **seed} for c in names]
    cfg_run = cfg.to_run_config() | {"nodes": len(nodes), "clients": cfg.clients or ",".join(names)}
    from fedheads.run.commands import FlowerRunConfig

    return simulate(lambda grid, ctx: run_federation(grid, ctx, FlowerRunConfig.from_run_config(ctx.run_config),
                                                     noise_seed),
                    nodes, cfg_run, client_app)
