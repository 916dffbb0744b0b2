"""Functional client optimisers on stacked parameters [M, ...] with a per-client `active` mask.

A client whose local epochs have no batch left at this step (it has fewer samples than the
largest client) must not change at all: parameters, moments and step counter stay as they are.
Semantics follow torch.optim.SGD / torch.optim.Adam exactly (L2 weight decay added to the
gradient, bias-corrected Adam; checked against torch for M=1 in tests/test_core_optim.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from embedcache.errors import UserError
from fedheads.core.config import setting
from fedheads.core.heads import Params


@dataclass(frozen=True)
class OptimizerConfig:
    """A client optimiser."""

    name: str = setting("adam", '"adam" or "sgd"')
    lr: float = setting(1e-3, "learning rate", source="FedPCL Sec. 5.1: Adam lr 1e-3")
    weight_decay: float = setting(1e-4, "L2 added to the gradient as torch does", source="FedPCL Sec. 5.1: 1e-4")
    momentum: float = setting(0.0, "SGD momentum (dampening 0, no Nesterov)")
    betas: tuple[float, float] = setting((0.9, 0.999), "Adam moment decay rates")
    eps: float = setting(1e-8, "Adam denominator epsilon")

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


def opt_initial(cfg: OptimizerConfig, params: Params, reset_every_round: bool) -> OptState:
    """The client optimiser state an algorithm starts with: with a per-round reset nothing needs
    to persist between rounds, so only the step counter is kept (moments are made per round)."""
    if reset_every_round:
        any_p = next(iter(params.values()))
        return OptState(torch.zeros(any_p.shape[0], dtype=torch.float64, device=any_p.device))
    return opt_init(cfg, params)


def _bcast(a: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return a.view(-1, *([1] * (like.dim() - 1)))


def _update(cfg: OptimizerConfig, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None,
            v: torch.Tensor | None, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One torch-semantics update of rows that all take the step (fused to few memory passes)."""
    if cfg.weight_decay:
        g = g.add(p, alpha=cfg.weight_decay)
    if cfg.name == "adam":
        b1, b2 = cfg.betas
        assert m is not None and v is not None
        m = torch.lerp(m, g, 1 - b1)  # torch.optim.Adam: exp_avg.lerp_(grad, 1 - beta1)
        v = v.mul(b2).addcmul_(g, g, value=1 - b2)
        bc1 = (1.0 - b1 ** step).to(p.dtype)
        bc2_sqrt = (1.0 - b2 ** step).sqrt().to(p.dtype)
        denom = v.sqrt().div_(_bcast(bc2_sqrt, p)).add_(cfg.eps)
        return torch.addcdiv(p, m * _bcast(-cfg.lr / bc1, p), denom), m, v
    if cfg.momentum:
        # torch: first step buf = g, later buf = momentum*buf + g; a zero buffer gives both.
        assert m is not None
        m = m.mul(cfg.momentum).add_(g)
        g = m
    return p.add(g, alpha=-cfg.lr), m, v


def id_runs(ids: Sequence[int], counts: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Maximal [a, b) ranges of consecutive client ids (with equal step counts when given): the
    row slices an in-place update of only these clients touches."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][1] == i and (counts is None or counts[i] == counts[out[-1][0]]):
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class InPlaceOptimizer:
    """In-place steps on stacked tensors the CALLER OWNS (local_train copies them once per round),
    with torch's fused multi-tensor kernels (torch._fused_adam_ / _fused_sgd_, the kernels behind
    torch.optim.Adam/SGD(fused=True)): one pass over p, g, m, v instead of ~ten elementwise passes
    over [M, Din, Dout] tensors far larger than the caches, which dominated the vectorised step.

    A client that takes no step is simply left out of the kernel's tensor lists, so it stays
    bit-for-bit unchanged. Clients are passed as slices [a:b) of consecutive active ids that share
    a step count (Adam's bias correction reads one step tensor per slice), so a round where all
    clients step together costs one kernel call per parameter. Step counts are tracked on the host
    (no device sync) and on the device as float32 (the fused kernels' step dtype).
    `grads` are consumed as scratch."""

    def __init__(self, cfg: OptimizerConfig, params: Params, state: OptState,
                 host_steps: Sequence[float] | None = None) -> None:
        self.cfg, self.params, self.m, self.v = cfg, params, state.m, state.v
        self.host = list(host_steps) if host_steps is not None else state.step.tolist()
        self.step32 = state.step.to(torch.float32)  # a copy: the caller's state is not modified
        self.all_ids = range(len(self.host))

    @torch.no_grad()
    def step(self, grads: Params, active: torch.Tensor, ids: Sequence[int] | None = None) -> None:
        """One step for clients `ids` (host ints, sorted; None = all); `active` [M] bool is the
        same set on the device."""
        cfg, ids = self.cfg, self.all_ids if ids is None else ids
        adam = cfg.name == "adam"
        runs = id_runs(ids, self.host if adam else None)
        if not runs:
            return
        for i in ids:
            self.host[i] += 1.0
        if len(runs) == 1 and runs[0] == (0, len(self.host)):
            self.step32.add_(1.0)
        else:
            self.step32.add_(active.to(torch.float32))
        keys = list(self.params)
        sl = lambda d: [d[k][a:b] for a, b in runs for k in keys]  # noqa: E731
        p, g = sl(self.params), sl(grads)
        if adam:
            steps = [self.step32[a] for a, _ in runs for _ in keys]
            torch._fused_adam_(p, g, sl(self.m), sl(self.v), [], steps, lr=cfg.lr, beta1=cfg.betas[0],
                               beta2=cfg.betas[1], weight_decay=cfg.weight_decay, eps=cfg.eps,
                               amsgrad=False, maximize=False)
        else:
            # torch.optim.SGD: first step buf = g, later momentum*buf + g; a zero buffer gives both
            torch._fused_sgd_(p, g, sl(self.m) if cfg.momentum else [], weight_decay=cfg.weight_decay,
                              momentum=cfg.momentum, lr=cfg.lr, dampening=0.0, nesterov=False,
                              maximize=False, is_first_step=False)

    def state(self) -> OptState:
        return OptState(step=self.step32.to(torch.float64), m=self.m, v=self.v)


def opt_step_(cfg: OptimizerConfig, params: Params, grads: Params, state: OptState,
              active: torch.Tensor) -> OptState:
    """One in-place step (see InPlaceOptimizer) of the clients with active[m]; `params` and the
    moment buffers of `state` are updated in place, the returned state holds the new counter.
    Reads `active` on the host: local_train uses InPlaceOptimizer directly (no sync)."""
    opt = InPlaceOptimizer(cfg, params, state)
    opt.step(grads, active, [i for i, a in enumerate(active.tolist()) if a])
    return opt.state()


@torch.no_grad()
def opt_step(cfg: OptimizerConfig, params: Params, grads: Params, state: OptState, active: torch.Tensor,
             rows: torch.Tensor | None = None) -> tuple[Params, OptState]:
    """One step for the clients with active[m]; the others are returned unchanged.

    `rows` (optional, [A] int64 = nonzero(active), built on the host by the caller so no device
    sync is needed) lets the update touch only the active clients' rows, and skips masking when
    every client is active. Without `rows` the update is computed for all and masked."""
    step = state.step + active.to(state.step.dtype)
    all_active = rows is not None and rows.numel() == active.numel()
    new_p: Params = {}
    new_m: Params = {}
    new_v: Params = {}
    for k, p in params.items():
        m_old, v_old = state.m.get(k), state.v.get(k)
        if all_active:
            new_p[k], m, v = _update(cfg, p, grads[k], m_old, v_old, step)
        elif rows is not None:
            def sel(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.index_select(0, rows)
            pr, m, v = _update(cfg, p.index_select(0, rows), grads[k].index_select(0, rows), sel(m_old), sel(v_old),
                               step.index_select(0, rows))
            new_p[k] = p.index_copy(0, rows, pr)
            m = None if m is None else m_old.index_copy(0, rows, m)  # type: ignore[union-attr]
            v = None if v is None else v_old.index_copy(0, rows, v)  # type: ignore[union-attr]
        else:
            pr, m, v = _update(cfg, p, grads[k], m_old, v_old, step.clamp_min(1.0))
            act = _bcast(active, p)
            new_p[k] = torch.where(act, pr, p)
            # _update returns a moment only for a moment it was given
            m = None if m is None or m_old is None else torch.where(act, m, m_old)
            v = None if v is None or v_old is None else torch.where(act, v, v_old)
        if m is not None:
            new_m[k] = m
        if v is not None:
            new_v[k] = v
    return new_p, OptState(step=step, m=new_m, v=new_v)


_OPT_KEYS = {"lr": "lr", "weight_decay": "weight_decay", "momentum": "momentum", "optimizer_name": "name"}


def config_from_kwargs(cfg_cls: type, kw: dict, opt_field: str = "optimizer") -> object:
    """Build a config dataclass from flat registry kwargs: lr / weight_decay / momentum /
    optimizer_name override fields of its OptimizerConfig (keeping the algorithm's defaults).
    An unknown option raises TypeError, as a dataclass does; the command line and the API check
    keys against the config's fields before building (fedheads.run.options, fedheads.run.train)."""
    fields = {f.name: f for f in dataclasses.fields(cfg_cls)}
    # a config's own field wins (pFedMe's `lr` is its eta, not an optimiser's)
    opt_keys = {k: n for k, n in _OPT_KEYS.items() if k not in fields} if opt_field in fields else {}
    rest = {k: v for k, v in kw.items() if k not in opt_keys}
    unknown = sorted(set(rest) - set(fields))
    if unknown:
        raise TypeError(f"{', '.join(unknown)}: unknown option(s) for {cfg_cls.__name__} "
                        f"(known: {', '.join(sorted(set(fields) | set(opt_keys)))})")
    over = {opt_keys[k]: v for k, v in kw.items() if k in opt_keys}
    if over:
        base = rest.get(opt_field)
        if base is None:
            f = fields[opt_field]
            base = f.default_factory() if f.default_factory is not dataclasses.MISSING else OptimizerConfig()  # type: ignore[misc]
        rest[opt_field] = dataclasses.replace(base, **over)
    return cfg_cls(**rest)
