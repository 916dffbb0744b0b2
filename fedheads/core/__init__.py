"""fedheads algorithm core: typed states + pure client/server functions (protocol.py), run by a
vectorised engine (all clients stacked) or a per-client loop (engine.py).

Building blocks: functional head ops with a leading client axis (ops.py, heads.py), functional
optimisers with a per-client active mask (optim.py), deterministic per-client batch schedules
(batching.py), the shared local step loop (train.py), counter-based randomness (rng.py),
stacked-tree helpers (tree.py), pluggable server optimisers (server_opt.py) and the federation held
on the device, padded or in size buckets (federation.py)."""

from fedheads.core.engine import (
    CommRecord,
    ParamCounts,
    RoundRecord,
    RunResult,
    count_parameters,
    evaluate,
    run,
    select_participants,
)
from fedheads.core.heads import HeadSpec, Params, count_params, init_head
from fedheads.core.optim import OptimizerConfig, OptState, opt_init, opt_step
from fedheads.core.protocol import Algorithm, Init, RoundCtx
from fedheads.core.server_opt import ServerOptimizer, ServerSGD
from fedheads.core.train import local_train
from fedheads.core.tree import payload_size, tree_cat, tree_index, tree_map, tree_scatter, tree_where

__all__ = [
    "Algorithm", "CommRecord", "ParamCounts", "count_parameters", "HeadSpec", "Init", "OptState", "OptimizerConfig", "Params",
    "RoundCtx",
    "RoundRecord", "RunResult", "ServerOptimizer", "ServerSGD", "count_params", "evaluate", "init_head",
    "local_train", "opt_init", "opt_step", "payload_size", "run", "select_participants", "tree_cat",
    "tree_index", "tree_map", "tree_scatter", "tree_where",
]
