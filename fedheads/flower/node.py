"""The ClientApp (`fedheads.flower.node:app`): one federation client per SuperNode.

A node is configured with its own data only (Flower node config, `fedheads join` flags):
  store     its feature store (required);
  client    which client of the store / manifest it is (default: the only one);
  manifest  its images' manifest: on first use the node runs `embedcache extract` into `store`
            (a cache hit afterwards); a manifest with several clients is cut to `client` first;
  device    where the head runs (default cpu); weights-dir: for the extraction.
Nothing but the replies below leaves the node. Its client state (tensors of M=1) lives in
`context.state` between rounds; the algorithm object is rebuilt from the run's settings in each
ClientApp process (Flower starts one per message in a deployment).

Messages (contract 8): query.describe -> what the server needs to initialise (sizes, class list
hash; no sample); train.update -> `client_update` on the broadcast, reply the message (or, under
SecAgg+, its clear part and one exponent per secure field; under DP also its release count);
train (SecAgg+ stages, through Flower's secaggplus_mod) -> the secure fields scaled into [-1, 1];
evaluate -> accuracy per rule. Under DP the node clips its features and, in distributed mode,
adds its noise share from its own key (fedheads/flower/dp.py; node config `dp-noise-seed`:
simulation and tests only)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from embedcache.errors import UserError
from fedheads.flower import require_flower
from fedheads.run.identity import classes_hash

require_flower()

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

# torch (through the codec) is imported by the handlers that need it: SecAgg+'s key stages run
# in ClientApp processes of their own and never need it

app = ClientApp()
_CACHE: dict[Any, Any] = {}  # per ClientApp process: loaded data and initialised algorithms


def node_settings(context: Context) -> dict[str, str]:
    cfg = {k: str(v) for k, v in dict(context.node_config).items()}
    if not cfg.get("store"):
        raise UserError("node config: 'store' is required (the node's own feature store)")
    return cfg


def _one_client_manifest(manifest: str, client: str, store: str) -> str:
    """The node's own manifest: `manifest` cut to `client` (written beside the store)."""
    import dataclasses

    from embedcache.manifest import load_manifest, save_manifest  # JSON + hashes, no torch

    m = load_manifest(manifest)
    names = [c.name for c in m.clients]
    if client and client not in names:
        raise UserError(f"node config: client {client!r} is not in {manifest} (has: {', '.join(names)})")
    if len(names) == 1:
        return manifest
    if not client:
        raise UserError(f"node config: {manifest} has {len(names)} clients; set client=NAME")
    own = dataclasses.replace(m, clients=tuple(c for c in m.clients if c.name == client))
    path = Path(store).with_suffix(".manifest.json")
    save_manifest(own, path)
    return str(path)


def ensure_features(cfg: dict[str, str], backbones: list[str]) -> None:
    """`embedcache extract` of the node's own manifest into its store (a cache hit when done)."""
    if not cfg.get("manifest"):
        return
    manifest = _one_client_manifest(cfg["manifest"], cfg.get("client", ""), cfg["store"])
    cmd = [sys.executable, "-m", "embedcache.cli", "extract", "--manifest", manifest, "--store", cfg["store"],
           "--backbones", ",".join(backbones), "--device", cfg.get("device", "cpu"), "--quiet"]
    if cfg.get("weights-dir"):
        cmd += ["--weights-dir", cfg["weights-dir"]]
    import fedheads.children as children

    res = children.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if res.returncode != 0:
        last = (res.stderr.strip() or res.stdout.strip() or "failed").splitlines()[-1]
        raise UserError(f"node {cfg.get('client') or cfg['store']}: embedcache extract: {last}")


def load_node_data(cfg: dict[str, str], backbones: list[str], binarize: bool, index: int = 0) -> Any:
    """The node's FedData (M=1) with its global client index (seeds its batches and noise)."""
    import dataclasses

    import torch

    from embedcache.store.reader import open_store
    from fedheads.run.load import load_fed_data

    key = ("data", cfg["store"], tuple(backbones), cfg.get("client", ""), binarize)
    if key not in _CACHE:
        clients = list(open_store(cfg["store"]).clients)
        client = cfg.get("client") or (clients[0] if len(clients) == 1 else "")
        if client not in clients:
            raise UserError(f"node config: client {client or '(unset)'!r}: store {cfg['store']} has "
                            f"{', '.join(clients)}; set client=NAME")
        _CACHE[key] = load_fed_data(cfg["store"], backbones, cfg.get("device", "cpu"), binarize=binarize,
                                    clients=[client])
    data = _CACHE[key]
    return dataclasses.replace(data, client_index=torch.tensor([index], device=data.device))


def _round_config(msg: Message) -> dict[str, Any]:
    return json.loads(str(msg.content.config_records["fh.run"]["json"]))


def _algorithm(run: dict[str, Any], dim: int, num_classes: int, device: Any, cfg: dict[str, str]) -> tuple[Any, Any]:
    """(algorithm, its Init for the federation), built once per process (init also sets the
    algorithm's head spec); the node keeps only its own row of the client state. Under DP
    (run["dp"]) the algorithm is wrapped in the run's mechanism with this node's own noise key
    (fedheads/flower/dp.py)."""
    import torch

    from fedheads.algorithms import create_algorithm
    from fedheads.core.federation import DataSpec
    from fedheads.flower.dp import node_algorithm, node_noise_seed

    dp = run.get("dp")
    key = ("alg", run["algorithm"], json.dumps(run["kwargs"], sort_keys=True), run["seed"], run["num_clients"], dim,
           num_classes, str(device), json.dumps(dp, sort_keys=True), cfg.get("dp-noise-seed", ""))
    if key not in _CACHE:
        alg = node_algorithm(create_algorithm(run["algorithm"], **run["kwargs"]), dp, node_noise_seed(cfg),
                             cfg.get("client") or cfg["store"])
        spec = DataSpec(dim, num_classes, run["num_clients"], tuple([0] * run["num_clients"]), torch.device(device))
        _CACHE[key] = alg, alg.init(spec, run["seed"])
    return _CACHE[key]


def _client_state(context: Context, alg_init: Any, index: int, device: Any) -> Any:
    import torch

    from fedheads.core.engine import to_device
    from fedheads.core.tree import tree_index
    from fedheads.flower import codec

    if codec.has(context.state, "fh.client_state"):
        return to_device(codec.take(context.state, "fh.client_state"), device)
    return tree_index(alg_init.client_state, torch.tensor([index], device=device))


def _setup(msg: Message, context: Context) -> tuple[dict[str, str], dict[str, Any], Any, Any, Any]:
    cfg, run = node_settings(context), _round_config(msg)
    data = load_node_data(cfg, run["backbones"], run["binarize"], run["index"])
    alg, init = _algorithm(run, data.dim, data.num_classes, data.device, cfg)
    return cfg, run, data, alg, _client_state(context, init, run["index"], data.device)


@app.query("describe")
def describe(msg: Message, context: Context) -> Message:
    """Extract on first use, then report what the server needs (no sample, no feature)."""
    from embedcache.store.reader import open_store
    from fedheads.run.train import store_fingerprint

    cfg = node_settings(context)
    run = json.loads(str(msg.content.config_records["fh.run"]["json"]))
    ensure_features(cfg, run["backbones"])
    data = load_node_data(cfg, run["backbones"], run["binarize"])
    info = open_store(cfg["store"])
    fp = store_fingerprint(info, run["backbones"])
    rec = ConfigRecord({"client": data.client_names[0], "domain": data.domains[0], "dim": data.dim,
                        "num_classes": data.num_classes, "classes": classes_hash(list(info.classes)),
                        "n_train": int(data.n_train[0]), "n_test": int(data.n_test[0]),
                        "backbones": json.dumps(fp["backbones"], sort_keys=True)})
    return Message(RecordDict({"fh.describe": rec}), reply_to=msg)


@app.train("update")
def update(msg: Message, context: Context) -> Message:
    """`client_update` with M=1 on the broadcast; the new client state stays in context.state."""
    import torch

    from fedheads.core.protocol import RoundCtx
    from fedheads.flower import codec

    cfg, run, data, alg, cs = _setup(msg, context)
    bc = codec.take(msg.content, "fh.broadcast")
    from fedheads.core.engine import to_device

    ctx = RoundCtx(run["round"], run["seed"], torch.tensor(run["participants"], dtype=torch.int64), run["num_clients"])
    cs, out = alg.client_update(cs, to_device(bc, data.device), data, ctx)
    codec.put(context.state, "fh.client_state", cs)
    reply = RecordDict()
    if run.get("dp") is not None:  # the count the server's accountant needs (fedheads/flower/dp.py)
        from fedheads.flower.dp import RELEASES, releases_of

        reply.config_records[RELEASES] = ConfigRecord({"releases": releases_of(cs)})
    if not run["secagg"]:
        codec.put(reply, "fh.message", out)
        return Message(reply, reply_to=msg)
    from fedheads.flower.secure import exponent, secure_form

    form = secure_form(alg, out)
    sums = form.sums(out)
    codec.put(context.state, "fh.pending", {k: v.cpu() for k, v in sums.items()})
    clear = form.clear(out)
    if clear is not None:
        codec.put(reply, "fh.message", clear)
    reply.config_records["fh.exponents"] = ConfigRecord({k: exponent(v) for k, v in sums.items()})
    return Message(reply, reply_to=msg)


@app.train(mods=[secaggplus_mod])
def secure_vector(msg: Message, context: Context) -> Message:
    """SecAgg+'s 'collect masked vectors' stage: the pending sums, scaled into [-1, 1] in
    float64; secaggplus_mod quantises and masks them and drops this plaintext record."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict

    from fedheads.flower import codec
    from fedheads.flower.secure import scale_down

    conf = msg.content.config_records["fitins.config"]
    names = str(conf["fields"]).split(",")
    pending = codec.take(context.state, "fh.pending")
    vec = [scale_down(pending[n].numpy(), int(conf[f"exp.{n}"])) for n in names]
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(vec), num_examples=1, metrics={})
    del context.state.array_records["fh.pending"], context.state.config_records["fh.pending" + codec.TREE_SUFFIX]
    return Message(fitres_to_recorddict(res, keep_input=False), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Accuracy of the node's test split per rule of `predict`, on the state `adapt_for_eval` gives."""
    from fedheads.core.engine import evaluate as evaluate_clients
    from fedheads.core.engine import to_device
    from fedheads.flower import codec

    cfg, run, data, alg, cs = _setup(msg, context)
    ss = to_device(codec.take(msg.content, "fh.server_state"), data.device)
    acc = evaluate_clients(alg, cs, ss, data, engine="loop")
    rec = MetricRecord({k: float(v[0]) for k, v in acc.items()})
    return Message(RecordDict({"fh.accuracy": rec}), reply_to=msg)
