"""Functional client optimisers on stacked parameters [M, ...] with a per-client `active` mask.

A client whose local epochs have no batch left at this step (it has fewer samples than the
largest client) must not change at all: parameters, moments and step counter stay as they are.
Semantics follow torch.optim.SGD / torch.optim.Adam exactly (L2 weight decay added to the
gradient, bias-corrected Adam; checked against torch for M=1 in tests/test_core_optim.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedheads.core.heads import Params
from embedcache.errors import UserError


@dataclass(frozen=True)
class OptimizerConfig:
    """A client optimiser."""

    name: str = "adam"  # "adam" or "sgd"
    lr: float = 1e-3  # learning rate (FedPCL Sec. 5.1: Adam lr 1e-3)
    weight_decay: float = 1e-4  # L2 added to the gradient as torch does (FedPCL: 1e-4)
    momentum: float = 0.0  # SGD momentum (dampening 0, no Nesterov)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam moment decay rates
    eps: float = 1e-8  # Adam denominator epsilon

    def __post_init__(self) -> None:
        if self.name not in ("adam", "sgd"):
            raise UserError(f"optimizer {self.name!r}: must be 'adam' or 'sgd'")
        if self.lr <= 0:
            raise UserError(f"lr {self.lr}: must be > 0")


@dataclass(frozen=True)
class OptState:
    """Optimiser state per client: step counter [M] and moment buffers like params."""

    step: torch.Tensor  # [M] float64 number of steps taken
    m: Params = field(default_factory=dict)  # Adam first moment / SGD momentum buffer
    v: Params = field(default_factory=dict)  # Adam second moment


def opt_init(cfg: OptimizerConfig, params: Params) -> OptState:
    """Zero state for stacked params."""
    any_p = next(iter(params.values()))
    step = torch.zeros(any_p.shape[0], dtype=torch.float64, device=any_p.device)
    m = {k: torch.zeros_like(p) for k, p in params.items()} if (cfg.name == "adam" or cfg.momentum) else {}
    v = {k: torch.zeros_like(p) for k, p in params.items()} if cfg.name == "adam" else {}
    return OptState(step=step, m=m, v=v)


def _bcast(a: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return a.view(-1, *([1] * (like.dim() - 1)))


@torch.no_grad()
def opt_step(cfg: OptimizerConfig, params: Params, grads: Params, state: OptState,
             active: torch.Tensor) -> tuple[Params, OptState]:
    """One step for the clients with active[m]; the others are returned unchanged."""
    step = state.step + active.to(state.step.dtype)
    new_p: Params = {}
    new_m: Params = {}
    new_v: Params = {}
    if cfg.name == "adam":
        b1, b2 = cfg.betas
        safe_step = step.clamp_min(1.0)
        bc1 = (1.0 - b1 ** safe_step).to(torch.float32)
        bc2_sqrt = (1.0 - b2 ** safe_step).sqrt().to(torch.float32)
    for k, p in params.items():
        g = grads[k]
        if cfg.weight_decay:
            g = g + cfg.weight_decay * p
        act = _bcast(active, p)
        if cfg.name == "adam":
            m = state.m[k] * b1 + g * (1 - b1)
            v = state.v[k] * b2 + g * g * (1 - b2)
            denom = v.sqrt() / _bcast(bc2_sqrt, p) + cfg.eps
            upd = p - (cfg.lr / _bcast(bc1, p)) * m / denom
            new_m[k] = torch.where(act, m, state.m[k])
            new_v[k] = torch.where(act, v, state.v[k])
        else:
            if cfg.momentum:
                # torch: first step buf = g, later buf = momentum*buf + g; a zero buffer gives both.
                buf = state.m[k] * cfg.momentum + g
                new_m[k] = torch.where(act, buf, state.m[k])
                g = buf
            upd = p - cfg.lr * g
        new_p[k] = torch.where(act, upd, p)
    return new_p, OptState(step=step, m=new_m, v=new_v)
