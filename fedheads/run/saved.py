"""A saved run directory read back (docs/contracts.md, 6): its algorithm rebuilt from config.json
and one seed's final states from state/seed<S>.pt. What `fedheads predict` classifies with, and
what an algorithm that reads another run starts from (CCVR's head=RUN_DIR: the drivers open the
runs an algorithm's settings name, `AlgorithmBase.saved_runs`, and hand them to it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms import create_algorithm
from fedheads.core.federation import DataSpec
from fedheads.core.tree import tree_leaves, tree_map
from fedheads.run.checkpoint import load_sealed, restore_tree, sealed, sized_like
from fedheads.run.load import resolve_device

STATE_FORMAT = "fedheads-state/1"


def state_blob(result: Any) -> dict[str, Any]:
    """What state/seed<S>.pt holds: the tensor leaves of a run's final states (a RunResult), in
    tree order (loadable with weights_only=True), sealed with their digest (fedheads.run.checkpoint)."""
    cs = [t.detach().cpu() for t in tree_leaves(result.client_state)]
    ss = [t.detach().cpu() for t in tree_leaves(result.server_state)]
    return sealed({"format": STATE_FORMAT, "client": cs, "server": ss})


def load_state(path: Path, algorithm: Any, spec: DataSpec, seed: int) -> tuple[Any, Any]:
    """Rebuild (client_state, server_state): the structure from `algorithm.init`, the values
    from the saved leaves (digest and shapes checked)."""
    if not path.is_file():
        raise UserError(f"{path}: no saved state (was the run trained with this seed?)")
    saved = load_sealed(path, STATE_FORMAT, "train the run again to rewrite it")
    init = algorithm.init(spec, seed)
    ss = sized_like(init.server_state, saved["server"], algorithm.server_sized_fields)
    return (restore_tree(init.client_state, saved["client"], path, "client", algorithm.name),
            restore_tree(ss, saved["server"], path, "server", algorithm.name))


@dataclass
class Trained:
    """A trained run read back: the algorithm and one seed's final states."""

    alg: Any
    client_state: Any  # client axis over `clients`
    server_state: Any
    clients: list[str]
    classes: list[str]  # class names (str(i) when the run recorded none: numpy arrays)
    backbones: list[str]
    fingerprint: dict[str, Any] | None  # config.json's store_fingerprint
    binarize: bool
    device: torch.device
    dim: int  # D of the concatenated features

    def client_index(self, client: str) -> int:
        if client not in self.clients:
            raise UserError(f"--client {client}: not a client of this run (clients: {', '.join(self.clients)})")
        return self.clients.index(client)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path}: missing (not a complete `fedheads train` run directory)")
    from embedcache.parsing import read_json as read

    return read(path)


def trained_from(config: Mapping[str, Any], results: Mapping[str, Any], states: Any, seed: int | None,
                 device: str) -> Trained:
    """A Trained from config.json / results.json dicts and `states`: a saved state file's path
    (loaded for the seed) or {seed: RunResult} (in memory)."""
    seeds = list(results["seeds"])
    seed = int(seeds[0]) if seed is None else seed
    if seed not in seeds:
        raise UserError(f"--seed {seed}: the run has seeds {seeds}")
    dev = resolve_device(device)
    alg = create_algorithm(config["algorithm"], **config.get("algorithm_kwargs", {}))
    clients, num_classes = list(results["clients"]), int(results["num_classes"])
    # the init's shapes depend on D, C and M only (server_sized_fields take their saved size);
    # every value is then replaced by the saved one
    spec = DataSpec(int(results["feature_dim"]), num_classes, len(clients), (1,) * len(clients), dev)
    if isinstance(states, (str, Path)):
        cs, ss = load_state(Path(states) / f"seed{seed}.pt", alg, spec, seed)
    else:
        alg.init(spec, seed)  # algorithms keep the spec they were initialised with
        run = states[seed]
        cs, ss = (tree_map(lambda t: t.to(dev), s) for s in (run.client_state, run.server_state))
    fp = config.get("store_fingerprint")
    classes = list(fp["classes"]) if fp else [str(i) for i in range(num_classes)]
    return Trained(alg, cs, ss, clients, classes, list(config["backbones"]), fp,
                   bool(config.get("options", {}).get("binarize", False)), dev, spec.dim)


def open_run(run_dir: str | Path, seed: int | None = None, device: str = "cpu") -> Trained:
    """The run directory's algorithm and the seed's saved states (default: the first seed)."""
    run_dir = Path(run_dir)
    results = read_json(run_dir / "results.json")
    if "algorithms" in results:
        raise UserError(f"{run_dir}: a comparison; predict with one of its runs ({', '.join(results['algorithms'])})")
    if "stages" in results and "figure1" in results:
        raise UserError(f"{run_dir}: a `fedheads finetune` run; `fedheads predict` serves it (its exported backbone "
                        "and final head), an algorithm's saved-run setting does not")
    return trained_from(read_json(run_dir / "config.json"), results, run_dir / "state", seed, device)


def attach_saved_runs(alg: Any, classes: Any = None, backbones: Mapping[str, Any] | None = None) -> None:
    """Open every run `alg`'s settings name (`saved_runs`) and hand it over (`use_saved`), after
    checking that it was trained on features of this run's `classes` and `backbones`
    (fedheads.run.identity.check_saved_run; None: trained from arrays, nothing to compare)."""
    from fedheads.run.identity import check_saved_run

    for key, (path, seed) in alg.saved_runs().items():
        where = f"{alg.name}: --set {key}={path}"
        check_saved_run(where, path, classes, backbones)
        alg.use_saved(key, open_run(path, seed))
