"""fedheads: federated heads (FedPCL, FedNCM, LP, MLP and the papers' baselines) trained
directly on cached frozen-backbone features, with a vectorised engine.

Python API (one function per command, see fedheads.api): `train`, `compare`, `predict`,
`finetune`, `list_algorithms`, `register_algorithm`, `Result`.

Packages: `core` (engine, protocol; torch only), `algorithms` (one file per paper), `run` (options,
loading a store into a federation, train/compare, run directories, checkpoints), `report`,
`prediction`, `finetuning`, `feddra`, `flower`. The packages holding `predict` and `finetune` are
named `prediction` and `finetuning` so that the API functions are never shadowed by a module."""

from __future__ import annotations

from fedheads.api import Result, compare, finetune, list_algorithms, predict, register_algorithm, train  # noqa: E402
from fedheads.version import __version__  # noqa: E402

__all__ = ["Result", "compare", "finetune", "list_algorithms", "predict", "register_algorithm", "train",
           "__version__"]
