"""Server optimisers for the head-tuning baselines (LP / MLP, FedNCM paper Sec. 4, App. B).

The server receives the n_i-weighted mean client delta Delta = sum_i n_i (w_i - w) / sum_i n_i
and applies one of (config field ``server_opt``):

- ``"fedavg"``  (McMahan et al. 2017): w <- w + eta * Delta with eta = 1 (core.ServerSGD).
- ``"fedprox"`` (Li et al., MLSys 2020, Eq. 2): the server is FedAvg's; the clients add the
  proximal term mu/2 ||w_i - w||^2 to their loss (done by the algorithm, not here).
- ``"fedadam"`` (Reddi et al., ICLR 2021, Algorithm 2 "FedOpt" with ServerOpt = Adam):
      m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
      v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
      w_{t+1} = w_t + eta * m_t / (sqrt(v_t) + tau)
  with m_{-1} = 0 and v_{-1} = tau^2 (Alg. 2 requires v_{-1} >= tau^2) and, as in Alg. 2, no
  bias correction. Defaults beta1 0.9, beta2 0.99, tau 1e-3 (Reddi et al. Sec. 5); the server
  learning rate eta defaults to 1e-3, the largest value of the FedNCM paper's FedAdam grid
  (App. B: {1e-3, 1e-4, 1e-5, 1e-6})."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.core.server_opt import ServerOptimizer, ServerSGD

Params = dict[str, torch.Tensor]
SERVER_OPTS = ("fedavg", "fedprox", "fedadam")


@dataclass(frozen=True)
class FedAdamState:
    m: Params  # first moment m_t (zeros at start)
    v: Params  # second moment v_t (tau^2 at start)


@dataclass(frozen=True)
class FedAdam:
    """Server Adam on the averaged delta (Reddi et al. 2021, Algorithm 2)."""

    lr: float = 1e-3  # eta, server learning rate
    beta1: float = 0.9  # first-moment decay
    beta2: float = 0.99  # second-moment decay
    tau: float = 1e-3  # adaptivity (denominator offset)

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.tau <= 0 or not (0 <= self.beta1 < 1) or not (0 <= self.beta2 < 1):
            raise UserError(f"fedadam lr={self.lr} tau={self.tau} betas=({self.beta1}, {self.beta2}): "
                            "need lr, tau > 0 and betas in [0, 1)")

    def init(self, params: Params) -> FedAdamState:
        return FedAdamState({k: torch.zeros_like(v) for k, v in params.items()},
                            {k: torch.full_like(v, self.tau ** 2) for k, v in params.items()})

    def step(self, params: Params, delta: Params, state: FedAdamState) -> tuple[Params, FedAdamState]:
        m = {k: self.beta1 * state.m[k] + (1 - self.beta1) * delta[k] for k in params}
        v = {k: self.beta2 * state.v[k] + (1 - self.beta2) * delta[k] ** 2 for k in params}
        new = {k: params[k] + self.lr * m[k] / (v[k].sqrt() + self.tau) for k in params}
        return new, FedAdamState(m, v)


def make_server_optimizer(name: str, lr: float | None = None, beta1: float = 0.9,
                          beta2: float = 0.99, tau: float = 1e-3) -> ServerOptimizer:
    """The server side of ``name`` in SERVER_OPTS; ``lr`` None = 1.0 (FedAvg/FedProx) or 1e-3 (FedAdam)."""
    if name not in SERVER_OPTS:
        raise UserError(f"server_opt {name!r}: must be one of {', '.join(SERVER_OPTS)}")
    if name == "fedadam":
        return FedAdam(1e-3 if lr is None else lr, beta1, beta2, tau)
    lr = 1.0 if lr is None else lr
    if lr <= 0:
        raise UserError(f"server_lr {lr}: must be > 0")
    return ServerSGD(lr=lr)
