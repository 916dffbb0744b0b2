"""Local training of all stacked clients at once: the step loop shared by every algorithm.

Each step gathers one mini-batch per client ([M, B, D]), evaluates the per-client losses [M],
back-propagates their sum (clients' parameters are disjoint, so each client gets exactly its
own gradient) and applies the functional optimiser with the step's `active` mask. There is no
host-device synchronisation inside the loop (no .item()): the number of steps is known on the
host from n_train.

Clients of different sizes take different numbers of steps; padded to the largest, a step would
compute every client while the small ones are done (at 40 or 80 label-skewed clients, 40 % of
the work). With `rowwise=True` (the loss treats each client's row on its own and captures no
per-client tensor) the clients are stacked in order of their step counts, largest first, for the
round, so the ones still stepping are always a prefix [0, k) and each step computes only those
k rows (views, nothing copied); the order is undone on return. Every client's result is the same
as unordered (its batches are keyed by its global index, core/batching.py). Clients stored in
that order already (FedData.by_size) need neither the reordering copies nor their undoing."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedheads.core import ops
from fedheads.core.batching import Schedule, make_schedule
from fedheads.core.federation import FedData
from fedheads.core.heads import Params
from fedheads.core.optim import InPlaceOptimizer, OptimizerConfig, OptState, opt_init
from fedheads.core.protocol import RoundCtx
from fedheads.core.tree import tree_where

# loss_fn(params, buffers, x [M,B,D], y [M,B], valid [M,B][, consts]) -> (loss per client [M], new buffers)
# Callable[..., ...]: the sixth argument is there only when local_train is given `consts`.
LossFn = Callable[..., tuple[torch.Tensor, Params]]


def gather_rows(x: torch.Tensor, index: torch.Tensor, clients: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, N, ...] rows index [K, B] of clients `clients` [K] (default: all M in order) ->
    [K, B, ...] (one row copy per index: ~5x faster on CPU than torch.gather with an index
    expanded over the feature axis, which goes element by element)."""
    if not x.is_contiguous():
        x = x if clients is None else x.index_select(0, clients)
        tail = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
        return torch.gather(x, 1, tail)
    M, N = x.shape[:2]
    rows = torch.arange(M, device=index.device) if clients is None else clients
    flat = (index + rows.view(-1, 1) * N).view(-1)
    return x.reshape(M * N, *x.shape[2:]).index_select(0, flat).view(*index.shape, *x.shape[2:])


def local_train(params: Params, buffers: Params, opt_state: OptState | None, opt_cfg: OptimizerConfig,
                loss_fn: LossFn, data: FedData, ctx: RoundCtx, batch_size: int,
                epochs: int, drop_last: bool = False, keep_opt: bool = True,
                rowwise: bool = False, consts: Params | None = None) -> tuple[Params, Params, OptState]:
    """Run `epochs` local epochs for every client in `data`; returns updated (params, buffers, opt).

    `opt_state=None` starts a fresh optimiser (as the papers' code building one per round);
    `drop_last` skips each epoch's partial last batch (core.batching.make_schedule).
    `keep_opt=False` says the caller discards the returned optimiser state (a per-round reset):
    the moments then live in reused scratch buffers and only the step counter is returned.
    `rowwise=True` promises that loss_fn computes each client's loss from its own rows of
    params / buffers / batch alone (what it captures has no client axis, or one of length 1):
    each step then computes only the clients still stepping (module docstring).
    `consts`: per-client tensors [M, ...] the loss reads but does not train (FedRep's personal head
    while its representation trains); given, loss_fn takes them as a sixth argument, their rows
    matching the params' rows in every step (so a rowwise loss may read them)."""
    sched = make_schedule(list(data.n_train), data.client_index, batch_size, epochs, ctx.seed,
                          ctx.round, data.device, drop_last=drop_last)
    M = data.num_clients
    perm, sched = order_by_steps(sched) if rowwise else (None, sched)
    if perm is not None:
        take = lambda t: t.index_select(0, perm)  # noqa: E731  (a private copy, reordered)
    else:
        take = lambda t: t.detach().clone(memory_format=torch.contiguous_format)  # noqa: E731
    keys = list(params)
    # functional at the boundary: private copies, then in-place steps (no per-step large allocations)
    params = {k: take(v.detach()) for k, v in params.items()}
    if perm is not None:
        buffers = {k: take(v) for k, v in buffers.items()}
        consts = None if consts is None else {k: v.index_select(0, perm) for k, v in consts.items()}
    with ops.buffer_pool(), ops.grad_workspace():
        if opt_state is None:
            opt_state, host_steps = fresh_opt_state(opt_cfg, params, keep_opt), [0.0] * M
        else:
            # one host read per round (not per step) of the counters Adam's bias correction needs
            host_steps = opt_state.step.tolist() if opt_cfg.name == "adam" else [0.0] * M
            if perm is not None:
                host_steps = [host_steps[i] for i in perm.tolist()]
            opt_state = OptState(opt_state.step if perm is None else opt_state.step.index_select(0, perm),
                                 {k: take(v) for k, v in opt_state.m.items()},
                                 {k: take(v) for k, v in opt_state.v.items()})
        opt = InPlaceOptimizer(opt_cfg, params, opt_state, host_steps)
        for s in range(sched.num_steps):
            buffers = _step(params, buffers, opt, loss_fn, data, sched, s, keys, M, rowwise, perm, consts)
        out = opt.state()
    if perm is not None:  # back to the data's client order
        restore_order_(perm, *((params, buffers, out.m, out.v) if keep_opt else (params, buffers)))
        out = OptState(out.step.index_select(0, inverse(perm)), out.m, out.v)
    return params, buffers, out if keep_opt else OptState(out.step)


SKIP_WORTH = 0.9  # reorder only when the padded steps would compute under 90 % real client-steps


def order_by_steps(sched: Schedule) -> tuple[torch.Tensor | None, Schedule]:
    """(perm, the schedule with its client axis in order perm) for a round's rowwise steps: the
    clients by step count, largest first, so the ones stepping at step s are the prefix
    [0, len(ids[s])); (None, sched) when skipping would save little (_by_steps). Client i of the
    reordered axis is client perm[i] of the data (gather_rows(..., clients=perm[:k]))."""
    order = _by_steps(sched.totals)
    if order is None or order == sorted(order):  # not worth it, or already in that order
        return None, sched
    perm = torch.tensor(order, dtype=torch.int64, device=sched.index.device)
    return perm, _reordered(sched, perm, [sched.totals[i] for i in order])


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """The permutation undoing `perm`: t.index_select(0, perm).index_select(0, inverse(perm)) == t."""
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    return back


def restore_order_(perm: torch.Tensor, *trees: Params) -> None:
    """In place: every tensor of the dicts `trees`, stacked in order `perm` (order_by_steps), put
    back in the data's client order, one tensor at a time (each reordered copy is freed as its
    successor is made: the peak holds one tensor more, not a second set)."""
    back = inverse(perm)
    for d in trees:
        for k in list(d):
            d[k] = d[k].index_select(0, back)


def _by_steps(totals: tuple[int, ...]) -> list[int] | None:
    """Client order by step count, largest first (stable); None when skipping would save little:
    the clients' steps fill at least SKIP_WORTH of the padded [steps x clients] grid (e.g. 4
    clients of 4, 4, 4 and 3 steps: the reordered copies would cost more than 1/16 of the GEMMs)."""
    if not totals or sum(totals) >= SKIP_WORTH * len(totals) * max(totals):
        return None
    return sorted(range(len(totals)), key=lambda i: -totals[i])


def _reordered(sched: Schedule, perm: torch.Tensor, totals: list[int]) -> Schedule:
    """`sched` with its client axis in order `perm`: the clients stepping at step s are then the
    prefix [0, k_s), and `ids[s]` says so."""
    ids, rows, cache = [], [], {}
    for st in range(sched.num_steps):
        k = sum(1 for t in totals if st < t)
        if k not in cache:
            cache[k] = tuple(range(k)), torch.arange(k, device=perm.device)
        ids.append(cache[k][0])
        rows.append(cache[k][1])
    return Schedule(index=sched.index.index_select(1, perm), valid=sched.valid.index_select(1, perm),
                    active=sched.active.index_select(1, perm), rows=tuple(rows), ids=tuple(ids),
                    totals=tuple(totals))


def fresh_opt_state(cfg: OptimizerConfig, params: Params, keep: bool) -> OptState:
    """Zero optimiser state for stacked `params`: fresh moment tensors, or (keep=False, the caller
    discards them after the round) the buffer pool's reused scratch, with no per-round allocation."""
    if keep:
        return opt_init(cfg, params)
    step = torch.zeros(next(iter(params.values())).shape[0], dtype=torch.float64,
                       device=next(iter(params.values())).device)
    need_m = cfg.name == "adam" or bool(cfg.momentum)
    m = {k: ops.scratch(f"opt.m.{k}", p).zero_() for k, p in params.items()} if need_m else {}
    v = {k: ops.scratch(f"opt.v.{k}", p).zero_() for k, p in params.items()} if cfg.name == "adam" else {}
    return OptState(step, m, v)


def _step(params: Params, buffers: Params, opt: InPlaceOptimizer, loss_fn: LossFn, data: FedData,
          sched: Schedule, s: int, keys: list[str], M: int, rowwise: bool = False,
          perm: torch.Tensor | None = None, consts: Params | None = None) -> Params:
    """One local step of every client (the gradient is consumed before the next step's backward).
    `rowwise` and the clients still stepping are rows [0, k) (always with `perm`, the clients
    reordered by step count; without it, when the data's clients come in that order already):
    only those are computed, on views of their params and buffers, their batches, [k, ...]
    gradients for the fused optimiser; the done clients' buffers are kept behind theirs."""
    ops.new_step()
    ids = sched.ids[s]
    all_on = len(ids) == M  # host-side: no device sync
    k = prefix_len(ids, M) if rowwise else M
    if k == 0:
        return buffers
    xb, yb, valid = step_batch(data, sched, s, k, perm)
    leaf = {n: params[n][:k].detach().requires_grad_(True) for n in keys}  # shares storage
    extra = () if consts is None else ({n: v[:k] for n, v in consts.items()},)
    with torch.enable_grad():
        loss, new_buf = loss_fn(leaf, {n: v[:k] for n, v in buffers.items()}, xb, yb, valid, *extra)
        grads = torch.autograd.grad(loss.sum(), [leaf[n] for n in keys], allow_unused=True)
    del leaf
    g = {n: (gn.contiguous() if gn is not None else torch.zeros_like(params[n][:k])) for n, gn in zip(keys, grads)}
    opt.step(g, sched.active[s], None if all_on else ids)
    new_buf = {n: v.detach() for n, v in new_buf.items()}
    return new_buf if all_on else step_buffers(sched.active[s], new_buf, buffers, k < M)


def prefix_len(ids: tuple[int, ...], M: int) -> int:
    """k when the clients stepping, `ids` (ascending), are the rows [0, k) of M; else M."""
    return len(ids) if not ids or ids[-1] == len(ids) - 1 else M


def step_batch(data: FedData, sched: Schedule, s: int, k: int,
               perm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [k,B,D], y [k,B], valid [k,B]) of step s for the first k clients of the schedule's order
    (`perm`: its client i is the data's client perm[i]; None: the data's own order)."""
    idx, valid = sched.index[s, :k], sched.valid[s, :k]
    if perm is None:
        return gather_rows(data.x_train[:k], idx), gather_rows(data.y_train[:k], idx), valid
    return gather_rows(data.x_train, idx, perm[:k]), gather_rows(data.y_train, idx, perm[:k]), valid


def step_buffers(active: torch.Tensor, new: Params, old: Params, prefix: bool) -> Params:
    """The buffers after a step: `new` for the clients that stepped, `old` for the others.
    `prefix`: `new` holds rows [0, k), the clients still stepping (order_by_steps); the clients
    already done keep theirs behind them."""
    if prefix:
        return {n: torch.cat([v, old[n][v.shape[0]:]]) for n, v in new.items()}
    return tree_where(active, new, old)
