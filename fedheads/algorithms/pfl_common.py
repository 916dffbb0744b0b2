"""Small pieces shared by the personalised baselines (fedrep, pfedme, perfedavg, solo) and the
head-tuning baselines (lp, mlp): stacking a global model over clients, the n_i-weighted mean of
client deltas (a sum of contributions, then a finalize), per-client gradients and masked updates
for algorithms with their own step loop, per-phase salting of the batch schedule, and config
building from the registry's flat kwargs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fedheads.core import heads
from fedheads.core.batching import Schedule, make_schedule
from fedheads.core.federation import FedData
from fedheads.core.heads import Params
from fedheads.core.optim import config_from_kwargs  # noqa: F401  (re-exported for the baselines)
from fedheads.core.protocol import RoundCtx
from fedheads.core.train import gather_rows, inverse, order_by_steps, prefix_len, restore_order_, step_batch, step_buffers  # noqa: F401 (re-exported)

# A forward+loss over stacked params: (params, buffers, x, y, valid) -> (loss [M], new buffers)
LossFn = Callable[[Params, Params, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Params]]


@dataclass(frozen=True)
class DeltaMessage:
    """Client -> server: a change of the shared parameters, weighted by n_i."""

    delta: Params  # [M, ...] w_i - w for the shared parameters
    buffer_delta: Params  # [M, ...] change of the shared BN running statistics
    weight: torch.Tensor  # [M] n_i, the client's training samples


@dataclass(frozen=True)
class GlobalModel:
    """The server's shared model (no client axis): its state, and what it broadcasts."""

    params: Params  # shared parameters (the whole head, or FedRep's representation only)
    buffers: Params  # their BN running statistics


@dataclass(frozen=True)
class Empty:
    """No payload (Solo: nothing is ever sent)."""


def expand(p: Params, M: int) -> Params:
    """A model without client axis copied to M clients (contiguous copies, to update in place)."""
    return {k: v.unsqueeze(0).expand(M, *v.shape).clone(memory_format=torch.contiguous_format) for k, v in p.items()}


def expand_view(p: Params, M: int) -> Params:
    """A model without client axis seen by M clients: broadcast views, nothing copied (to read
    from; `expand` makes the copies a client loop updates in place)."""
    return {k: v.unsqueeze(0).expand(M, *v.shape) for k, v in p.items()}


def weighted_mean(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_i w_i t_i / sum_i w_i over the client axis: one contraction (a GEMV reading t once)
    instead of a weighted copy of the whole [M, ...] stack and a sum over it."""
    return torch.tensordot(w.to(t.dtype), t, dims=1) / w.sum()


def mean_delta(msg: DeltaMessage) -> tuple[Params, Params]:
    """(Delta params, Delta buffers): n_i-weighted means of the clients' deltas."""
    return ({k: weighted_mean(v, msg.weight) for k, v in msg.delta.items()},
            {k: weighted_mean(v, msg.weight) for k, v in msg.buffer_delta.items()})


def apply_mean_delta(ss: GlobalModel, msg: DeltaMessage, step: float = 1.0) -> GlobalModel:
    """The server step of FedAvg-style baselines: w + step * (n_i-weighted mean delta); BN
    running statistics move by their plain weighted mean delta (pFedMe's beta is `step`)."""
    d, db = mean_delta(msg)
    return GlobalModel({k: ss.params[k] + step * d[k] for k in ss.params},
                       {k: ss.buffers[k] + db[k] for k in ss.buffers})


def personal_and_global_scores(spec: Any, personal: Params, buffers: Params, ss: GlobalModel,
                               x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Scores of each client's personalised model ("main") and of the global model."""
    M = x.shape[0]
    gp, gb = expand_view(ss.params, M), expand_view(ss.buffers, M)
    zp, _ = heads.embed(spec, personal, buffers, x, mask, train=False)
    zg, _ = heads.embed(spec, gp, gb, x, mask, train=False)
    return {"main": heads.classify(personal, zp), "global_model": heads.classify(gp, zg)}


def delta_message(new_p: Params, start_p: Params, new_b: Params, start_b: Params, data: FedData) -> DeltaMessage:
    w = torch.tensor(data.n_train, dtype=torch.float32, device=data.device)
    return DeltaMessage({k: new_p[k] - start_p[k] for k in start_p},
                        {k: new_b[k] - start_b[k] for k in start_b}, w)


def salted(ctx: RoundCtx, phase: int) -> RoundCtx:
    """A ctx whose batch shuffles are independent of phase 0's (two local phases, or the two
    batches D and D' of a MAML step, must not see the same order). Rounds are < 2**20."""
    return dataclasses.replace(ctx, round=ctx.round + (phase << 20)) if phase else ctx


def schedule(data: FedData, ctx: RoundCtx, batch_size: int, epochs: int) -> Schedule:
    """The core's seeded per-client batch schedule for this round (same in both engines)."""
    return make_schedule(list(data.n_train), data.client_index, batch_size, epochs, ctx.seed,
                         ctx.round, data.device)


def rows(p: Params, k: int) -> Params:
    """Views of the first k client rows."""
    return {n: v[:k] for n, v in p.items()}


def in_data_order(perm: torch.Tensor | None, *trees: Params) -> tuple[Params, ...]:
    """`trees` stacked in order `perm` (order_by_steps) put back in the data's client order."""
    if perm is None:
        return trees
    out = tuple(dict(t) for t in trees)
    restore_order_(perm, *out)
    return out


def grads(loss_fn: LossFn, params: Params, buffers: Params, x: torch.Tensor, y: torch.Tensor,
          valid: torch.Tensor) -> tuple[Params, Params, torch.Tensor]:
    """Per-client gradients of loss_fn at params (the clients' losses are summed: parameters are
    disjoint per client, so each client gets its own gradient). Returns (grads, buffers, loss [M])."""
    keys = list(params)
    leaf = {k: params[k].detach().requires_grad_(True) for k in keys}
    with torch.enable_grad():
        loss, nb = loss_fn(leaf, buffers, x, y, valid)
        g = torch.autograd.grad(loss.sum(), [leaf[k] for k in keys], allow_unused=True)
    out = {k: (gk if gk is not None else torch.zeros_like(params[k])) for k, gk in zip(keys, g)}
    return out, {k: v.detach() for k, v in nb.items()}, loss.detach()
