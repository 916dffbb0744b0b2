"""fedheads: federated heads (FedPCL, FedNCM, LP, MLP and the papers' baselines) trained
directly on cached frozen-backbone features, with a vectorised engine.

Python API (one function per command, see fedheads.api): `train`, `compare`, `predict`,
`finetune`, `feddra`, `load`, `settings`, `list_algorithms`, `register_algorithm`, `Result`.

Packages: `core` (engine, protocol; torch only), `algorithms` (one file per paper), `run` (options,
loading a store into a federation, train/compare, run directories, checkpoints), `report`,
`prediction`, `finetuning`, `alignment` (FedDRA), `flower`. The packages holding `predict`,
`finetune` and `feddra` are named `prediction`, `finetuning` and `alignment` so that the API
functions are never shadowed by a module."""

from __future__ import annotations

from fedheads.api import (  # noqa: E402
    Result,
    compare,
    feddra,
    finetune,
    list_algorithms,
    load,
    predict,
    register_algorithm,
    settings,
    train,
)
from fedheads.version import __version__  # noqa: E402

__all__ = ["Result", "compare", "feddra", "finetune", "list_algorithms", "load", "predict", "register_algorithm",
           "settings", "train", "__version__"]
