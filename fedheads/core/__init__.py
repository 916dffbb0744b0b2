"""fedheads algorithm core: typed states + pure client/server functions (protocol.py), run by a
vectorised engine (all clients stacked) or a per-client loop (engine.py).

Building blocks: functional head ops with a leading client axis (ops.py, heads.py), functional
optimisers with a per-client active mask (optim.py), deterministic per-client batch schedules
(batching.py), the shared local step loop (train.py), counter-based randomness (rng.py),
stacked-tree helpers (tree.py), pluggable server optimisers (server_opt.py), the federation held
on the device, padded or in size buckets (federation.py), and settings that document themselves
(config.py, which needs no torch: the names below are imported when first used)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "engine": ("CommRecord", "ParamCounts", "RoundRecord", "RunResult", "count_parameters", "evaluate", "run",
               "select_participants"),
    "heads": ("HeadSpec", "Params", "count_params", "init_head"),
    "optim": ("OptimizerConfig", "OptState", "opt_init", "opt_step"),
    "protocol": ("Algorithm", "Init", "RoundCtx"),
    "server_opt": ("ServerOptimizer", "ServerSGD"),
    "train": ("local_train",),
    "tree": ("payload_size", "tree_cat", "tree_index", "tree_map", "tree_scatter", "tree_where"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fedheads.core' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fedheads.core.{module}"), name)
