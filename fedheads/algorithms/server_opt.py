"""Server optimisers for the head-tuning baselines (LP / MLP, FedNCM paper Sec. 4, App. B).

The server receives the n_i-weighted mean client delta Delta = sum_i n_i (w_i - w) / sum_i n_i
and applies one of (config field ``server_opt``):

- ``"fedavg"``  (McMahan et al. 2017): w <- w + eta * Delta with eta = 1 (core.ServerSGD).
- ``"fedprox"`` (Li et al., MLSys 2020, Eq. 2): the server is FedAvg's; the clients add the
  proximal term mu/2 ||w_i - w||^2 to their loss (done by the algorithm, not here).
- ``"fedavgm"`` (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data Distribution"):
  server SGD with momentum beta on the pseudo-gradient g = -Delta, v <- beta v + Delta,
  w <- w + eta v (core.ServerSGD(momentum=beta)); the same as torch.optim.SGD(lr=eta,
  momentum=beta, dampening 0) stepping on g, which is FLSim's FedAvgWithLR server optimiser, the
  one the FedNCM authors' code offers. Defaults eta = 1, beta = 0.9 (Hsu et al.'s usual value).
- ``"fedadam"``: server Adam on the pseudo-gradient g = -Delta, in one of two flavours
  (``FedAdam.flavour``):

  * ``"flsim"`` (default): torch.optim.Adam on g, as FLSim's FedAdamOptimizer does it, the
    library the FedNCM paper ran (Sec. 4) and whose server learning rates its App. B grid
    {1e-3, 1e-4, 1e-5, 1e-6} was tuned for. FLSim's defaults: betas (0.9, 0.999), eps 1e-8,
    weight decay 1e-5 (added to g as torch does), bias-corrected moments:
        g_t = -Delta_t + wd * w_t
        m_t = beta1 m_{t-1} + (1 - beta1) g_t,   v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
        w_{t+1} = w_t - eta / (1 - beta1^t) * m_t / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)
    Its first step is w - eta * sign(g) (for |g| >> eps), whatever the size of Delta.
  * ``"reddi"``: Reddi et al., ICLR 2021, Algorithm 2 ("FedOpt" with ServerOpt = Adam):
        m_t = beta1 m_{t-1} + (1 - beta1) Delta_t,   v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
        w_{t+1} = w_t + eta * m_t / (sqrt(v_t) + tau)
    with m_{-1} = 0, v_{-1} = tau^2 (Alg. 2 requires v_{-1} >= tau^2), no bias correction, no
    weight decay; defaults beta1 0.9, beta2 0.99, tau 1e-3 (Reddi et al. Sec. 5). Its first
    step is eta * 0.1 Delta / (sqrt(0.01 Delta^2 + 0.99 tau^2) + tau): eta/20 at |Delta| = tau
    and less for smaller deltas, where flsim moves by eta: the App. B grid's step sizes mean
    far less here.

  The server learning rate eta defaults to 1e-3, the largest value of the FedNCM paper's
  FedAdam grid (App. B)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.core.server_opt import ServerOptimizer, ServerSGD

Params = dict[str, torch.Tensor]
SERVER_OPTS = ("fedavg", "fedprox", "fedadam", "fedavgm")
MOMENTUM_SERVERS = ("fedadam", "fedavgm")  # server optimisers with state (FLSim steps model parameters only)


FLAVOURS = ("flsim", "reddi")
_FLAVOUR_DEFAULTS = {"flsim": (0.999, 1e-8, 1e-5), "reddi": (0.99, 1e-3, 0.0)}  # beta2, eps/tau, wd


@dataclass(frozen=True)
class FedAdamState:
    m: Params  # first moment m_t (zeros at start)
    v: Params  # second moment v_t (zeros at start for flsim, tau^2 for reddi)
    t: int = 0  # steps taken (bias correction of the flsim flavour)


@dataclass(frozen=True)
class FedAdam:
    """Server Adam on the averaged delta: FLSim's torch Adam or Reddi et al. 2021, Algorithm 2."""

    lr: float = 1e-3  # eta, server learning rate
    beta1: float = 0.9  # first-moment decay
    beta2: float | None = None  # second-moment decay; None = 0.999 (flsim) / 0.99 (reddi)
    tau: float | None = None  # denominator offset: torch's eps (flsim, 1e-8) / Reddi's tau (1e-3)
    flavour: str = "flsim"  # "flsim" (bias-corrected torch Adam on -Delta) or "reddi" (Alg. 2)
    weight_decay: float | None = None  # L2 added to the pseudo-gradient; None = 1e-5 (FLSim) / 0 (reddi)

    def __post_init__(self) -> None:
        if self.flavour not in FLAVOURS:
            raise UserError(f"adam_flavour {self.flavour!r}: must be one of {', '.join(FLAVOURS)}")
        for name, default in zip(("beta2", "tau", "weight_decay"), _FLAVOUR_DEFAULTS[self.flavour]):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)  # frozen: resolve the flavour's default once
        beta2, tau, wd = self.resolved()
        if self.lr <= 0 or tau <= 0 or not (0 <= self.beta1 < 1) or not (0 <= beta2 < 1):
            raise UserError(f"fedadam lr={self.lr} tau={tau} betas=({self.beta1}, {beta2}): "
                            "need lr, tau > 0 and betas in [0, 1)")
        if wd < 0 or (wd and self.flavour == "reddi"):
            raise UserError(f"adam_weight_decay {wd}: must be >= 0, and 0 for 'reddi'")

    def resolved(self) -> tuple[float, float, float]:
        """(beta2, tau, weight_decay), the flavour's defaults filled in by __post_init__."""
        assert self.beta2 is not None and self.tau is not None and self.weight_decay is not None
        return self.beta2, self.tau, self.weight_decay

    def init(self, params: Params) -> FedAdamState:
        v0 = 0.0 if self.flavour == "flsim" else self.resolved()[1] ** 2
        return FedAdamState({k: torch.zeros_like(v) for k, v in params.items()},
                            {k: torch.full_like(v, v0) for k, v in params.items()})

    def step(self, params: Params, delta: Params, state: FedAdamState) -> tuple[Params, FedAdamState]:
        beta2, tau, wd = self.resolved()
        if self.flavour == "reddi":
            m = {k: self.beta1 * state.m[k] + (1 - self.beta1) * delta[k] for k in params}
            v = {k: beta2 * state.v[k] + (1 - beta2) * delta[k] ** 2 for k in params}
            new = {k: params[k] + self.lr * m[k] / (v[k].sqrt() + tau) for k in params}
            return new, FedAdamState(m, v, state.t + 1)
        t = state.t + 1
        g = {k: wd * params[k] - delta[k] for k in params}  # pseudo-gradient + L2
        m = {k: torch.lerp(state.m[k], g[k], 1 - self.beta1) for k in params}
        v = {k: state.v[k] * beta2 + (1 - beta2) * g[k] * g[k] for k in params}
        step = self.lr / (1 - self.beta1 ** t)
        bc2 = math.sqrt(1 - beta2 ** t)
        new = {k: params[k] - step * m[k] / (v[k].sqrt() / bc2 + tau) for k in params}
        return new, FedAdamState(m, v, t)


def make_server_optimizer(name: str, lr: float | None = None, beta1: float = 0.9,
                          beta2: float | None = None, tau: float | None = None,
                          flavour: str = "flsim", weight_decay: float | None = None,
                          momentum: float = 0.9) -> ServerOptimizer:
    """The server side of ``name`` in SERVER_OPTS; ``lr`` None = 1.0 (FedAvg/FedProx/FedAvgM) or 1e-3
    (FedAdam); beta2 / tau / weight_decay None = the flavour's defaults (module docstring);
    ``momentum``: FedAvgM's beta (fedavgm only)."""
    if name not in SERVER_OPTS:
        raise UserError(f"server_opt {name!r}: must be one of {', '.join(SERVER_OPTS)}")
    if name == "fedadam":
        return FedAdam(1e-3 if lr is None else lr, beta1, beta2, tau, flavour, weight_decay)
    lr = 1.0 if lr is None else lr
    if lr <= 0:
        raise UserError(f"server_lr {lr}: must be > 0")
    if name == "fedavgm":
        if not 0 < momentum < 1:
            raise UserError(f"server_momentum {momentum}: FedAvgM needs a momentum in (0, 1)")
        return ServerSGD(lr=lr, momentum=momentum)
    return ServerSGD(lr=lr)
