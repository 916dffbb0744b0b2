"""fedheads: federated heads (FedPCL, FedNCM, LP, MLP and the papers' baselines) trained
directly on cached frozen-backbone features, with a vectorised engine.

Python API (one function per command, see fedheads.api): `train`, `compare`, `predict`,
`finetune`, `list_algorithms`, `register_algorithm`, `Result`."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from fedheads.api import Result, compare, finetune, list_algorithms, register_algorithm, train  # noqa: E402

__all__ = ["Result", "compare", "finetune", "list_algorithms", "predict", "register_algorithm", "train",
           "__version__"]


def __getattr__(name: str) -> Any:
    # `fedheads.predict` is the module fedheads/predict.py, callable as fedheads.api.predict
    # (embedcache.callable_module): imported on first use, so `import fedheads` stays light
    if name == "predict":
        return importlib.import_module("fedheads.predict")
    raise AttributeError(f"module 'fedheads' has no attribute {name!r}")
