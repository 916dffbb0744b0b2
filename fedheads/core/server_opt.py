"""Pluggable server optimisers for parameter-averaging algorithms.

The server receives the weighted mean client delta  Delta = sum_i w_i (theta_i - theta) / sum_i w_i
and treats -Delta as a pseudo-gradient (Reddi et al., ICLR 2021, Algorithm 2). FedAvg
(McMahan et al., AISTATS 2017) is server SGD with lr 1: theta <- theta + Delta. FedAdam / FedYogi
/ FedAvgM plug in here by implementing the same two functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

Params = dict[str, torch.Tensor]


class ServerOptimizer(Protocol):
    """theta, Delta without client axis."""

    def init(self, params: Params) -> Any:
        ...

    def step(self, params: Params, delta: Params, state: Any) -> tuple[Params, Any]:
        ...


@dataclass(frozen=True)
class ServerSGD:
    """theta <- theta + lr * (Delta + momentum buffer); lr=1, momentum=0 is FedAvg."""

    lr: float = 1.0  # server learning rate (FedAvg: 1)
    momentum: float = 0.0  # server momentum (FedAvgM when > 0)

    def init(self, params: Params) -> Params:
        return {k: torch.zeros_like(v) for k, v in params.items()} if self.momentum else {}

    def step(self, params: Params, delta: Params, state: Params) -> tuple[Params, Params]:
        if self.momentum:
            state = {k: self.momentum * state[k] + delta[k] for k in params}
            return {k: params[k] + self.lr * state[k] for k in params}, state
        return {k: params[k] + self.lr * delta[k] for k in params}, state
