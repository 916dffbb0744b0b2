"""The algorithm protocol every fedheads algorithm implements, and the types the engines pass.

An algorithm is typed state plus pure functions (fedjax style); the engines decide how clients
run. Conventions:
- A client state and a client->server message are frozen dataclasses whose tensor leaves all
  have a leading client axis [M, ...]. The vectorised engine passes all participating clients
  at once; the loop engine passes one (M=1) and concatenates the messages; a networked driver
  would pass one. The maths never knows which.
- Server state and broadcast have no client axis. The broadcast is what every participant
  receives; the engine counts its size once per participant as downlink traffic.
- Server aggregation is written as SUMS of client contributions followed by a small finalize
  (weighted prototype = sum(count*proto)/sum(count), FedAvg = sum(w*delta)/sum(w)), so the same
  algorithm could later run under secure aggregation.
- Randomness is a pure function of (seed, round, client global index, ...) (core/rng.py,
  core/batching.py), never of the order in which clients are processed; per-client
  initialisations take their seeds from DataSpec.client_ids (core/heads.client_seeds).
- Message sizes: `core.tree.payload_size` (numel and bytes of every field sent, or the type's
  own `comm_size()`), so the engine logs communication actually sent up and down per round.
- Optional eval-time hook `adapt_for_eval(client_state, server_state, data) -> client_state`
  (not part of the Protocol class, so algorithms without it still satisfy it): an algorithm
  whose reported model is a client-side adaptation of the CURRENT server model (Per-FedAvg's
  one-step personalisation) defines it. Both engines call it before every evaluation, on all
  clients (loop engine: one client at a time, M=1), never feed its result back into training,
  and return the last adapted state as the run's final client state, so a saved state predicts
  what was evaluated. It must be a pure function of its arguments (same in both engines).
- Optional attribute `global_rule: str` (also outside the Protocol class): the key of `predict`
  whose scores depend on the server state alone (the same for every client), i.e. the run's global
  model. `fedheads predict --images` classifies images that belong to no client with it; an
  algorithm without it (personalised heads, local prototypes) needs `--client`.
- Optional attribute `server_client_fields: tuple[str, ...]`: the server-state fields that, against
  the convention above, hold one row per client of the federation (FedPCL's prototype bank; () for
  none). Declaring it lets the vectorised engine stack the clients in the order it computes
  fastest in (core/order.py) and put these rows back in the data's order with the client state;
  an algorithm without it is run in the data's order.
  Key per-client randomness by global ids (data.client_index, DataSpec.ids(),
  core/heads.client_seeds), never by a client's position in the stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

import torch

from fedheads.data import DataSpec, FedData

CS = TypeVar("CS")  # client state (stacked)
SS = TypeVar("SS")  # server state
Msg = TypeVar("Msg")  # client -> server message (stacked)
Bc = TypeVar("Bc")  # server -> client broadcast


@dataclass(frozen=True)
class RoundCtx:
    """What a client or server function may know about the round."""

    round: int  # 0-based communication round
    seed: int  # run seed (combine with round and client_index for randomness)
    participants: torch.Tensor  # [P] int64 positions in the stacked federation of this round's participants
    # (sorted; global ids only where the engine keeps the data's order: data.client_index holds them)
    num_clients: int  # M of the whole federation


@dataclass(frozen=True)
class Init(Generic[CS, SS, Bc]):
    """Result of Algorithm.init."""

    client_state: CS  # stacked over ALL clients of the federation
    server_state: SS
    broadcast: Bc  # what round 0's participants receive


@runtime_checkable
class Algorithm(Protocol[CS, SS, Msg, Bc]):
    """A federated algorithm on cached features. `name` is used in logs and result files."""

    name: str

    def init(self, spec: DataSpec, seed: int) -> Init[CS, SS, Bc]:
        """States for the whole federation (client axis = spec.num_clients) and the first broadcast."""
        ...

    def client_update(self, client_state: CS, broadcast: Bc, data: FedData, ctx: RoundCtx) -> tuple[CS, Msg]:
        """Local work of the clients in `data` (client axis of client_state matches data)."""
        ...

    def server_aggregate(self, server_state: SS, messages: Msg, ctx: RoundCtx) -> tuple[SS, Bc]:
        """Combine the participants' stacked messages (rows ordered as ctx.participants)."""
        ...

    def predict(self, client_state: CS, server_state: SS, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scores [M, N, C] for x [M, N, D] (argmax = prediction). Key "main" is the algorithm's
        own inference rule; other keys are extra rules reported alongside (e.g. "global_model")."""
        ...

    def trainable_params(self, client_state: CS) -> int:
        """Trainable values held per client (counted from the actual tensors)."""
        ...
