"""Communication accounting, measured and by the papers' conventions (kept apart).

Two views, never mixed:

* **Measured** (``CommLedger``): the sizes of the messages an engine actually sent, summed
  per direction over rounds and participating clients. A message is a flat record of named
  arrays with a leading client axis (house style); each client's share is its row.
* **Paper conventions**: closed-form counts that reproduce the published figures from the
  architecture, so a results table can show the column the papers show:
  - FedPCL (Tan et al., NeurIPS 2022) Table 2 "# of Comm Params" (average parameters a
    client sends per round) and Table 14 "# of Training Params". The paper counts weight
    matrices only (no biases, no BN): with K backbones of 512-d, a 256-d projection and 10
    classes, FedAvg = 512K*256 + 256*10 (133,632 / 395,776), FedRep = 512K*256 (131,072 /
    393,216; the classifier stays local), FedProto / FedPCL = 10*256 prototypes (2,560),
    pFedMe / Per-FedAvg = FedAvg, Solo = 0 (printed "-").
  - FedNCM (Legate et al., NeurIPS 2023) Appendix A, Eq. 3 (HeadTuning: LP, FedNCM) and
    Eq. 4 (full fine-tuning: FT, FedNCM+FT), 32-bit parameters, up and down; Eq. 5-6 for
    compute in units of one forward pass F.
  - Totals per direction (``paper_comm_bytes``): upload and download per client per round
    are method-specific. FedPCL downloads far more than it uploads: (m+1) x C x d, every
    client's local set plus the global set (Sec. 4, Eq. 7), so the symmetric Eq. 3 form
    (``paper_total_bytes``) is only right for methods that receive what they send.

Notes on reproducing FedNCM Table 2 (decimal GB = 1e9 bytes):
  - Every figure, CIFAR-10 included, reproduces with F = 1 (full participation), although the
    text says 30 % participation for CIFAR-10.
  - The FT / Random / FedNCM+FT figures all imply a base model of P = 746,424 parameters
    (``FEDNCM_TABLE2_BASE_PARAMS``, inferred from the table: torchvision's SqueezeNet 1.0
    feature extractor has 735,424, SqueezeNet 1.1 722,496; the paper does not say which
    model definition FLSim used).
  - FedNCM+FT is printed equal to FT: the FedNCM round is not counted there.
  - LP on Flowers-102 (20.93 GB) is the one figure that needs the classifier bias counted
    (LL_in = 513); CUB and Cars need it left out. ``include_bias`` offers both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embedcache.errors import UserError
from fedheads.core.protocol import HeadArch, PaperRoundComm

BITS_PER_PARAM = 32  # FedNCM Sec. 4: "each model parameter ... a 32-bit floating point number"
FEDNCM_TABLE2_BASE_PARAMS = 746_424  # P of Eq. 4 implied by FedNCM Table 2 (see module doc)

# ----------------------------------------------------------------------------- measured


def _nelem_per_client(arr: Any) -> tuple[int, int]:
    shape = tuple(arr.shape)
    if len(shape) == 0:
        raise UserError("message array: a scalar has no client axis")
    per = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    itemsize = int(arr.dtype.itemsize)  # numpy dtypes and torch dtypes (>= 2.1) both have it
    return per, per * itemsize


def message_size(message: Mapping[str, Any]) -> tuple[int, int, int]:
    """(clients, params per client, bytes per client) of a flat record of named arrays.

    Every array must share the leading client axis; accepts numpy arrays and torch tensors
    (anything with ``.shape`` and ``.dtype``)."""
    if not message:
        raise UserError("message: empty record")
    m = None
    params = nbytes = 0
    for name, arr in message.items():
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise UserError(f"message[{name!r}]: not an array")
        if m is None:
            m = int(arr.shape[0]) if len(arr.shape) else 0
        if len(arr.shape) == 0 or int(arr.shape[0]) != m:
            raise UserError(f"message[{name!r}]: leading axis {tuple(arr.shape)[:1]} != {m} clients")
        p, b = _nelem_per_client(arr)
        params += p
        nbytes += b
    return int(m or 0), params, nbytes


@dataclass
class CommLedger:
    """Running totals of what was actually sent. Mutable on purpose: an engine owns one per
    run and calls :meth:`add` once per message."""

    up_params: int = 0  # parameters sent client -> server, summed over clients and rounds
    up_bytes: int = 0  # bytes sent client -> server
    down_params: int = 0  # parameters sent server -> client (counted once per receiver)
    down_bytes: int = 0  # bytes sent server -> client
    rounds: set[int] = field(default_factory=set)  # rounds that sent anything
    up_messages: int = 0  # number of (client, round) uploads

    def add(self, round_: int, direction: str, params_per_client: int,
            bytes_per_client: int, clients: int) -> None:
        """Record one message of ``clients`` rows, each of the given size."""
        if direction not in ("up", "down"):
            raise UserError(f"direction={direction!r}: must be 'up' or 'down'")
        if min(params_per_client, bytes_per_client, clients) < 0:
            raise UserError("message size: negative count")
        self.rounds.add(int(round_))
        if direction == "up":
            self.up_params += params_per_client * clients
            self.up_bytes += bytes_per_client * clients
            self.up_messages += clients
        else:
            self.down_params += params_per_client * clients
            self.down_bytes += bytes_per_client * clients

    def add_message(self, round_: int, direction: str, message: Mapping[str, Any],
                    receivers: int | None = None) -> None:
        """Record a flat record with a leading client axis. A broadcast (one row sent to
        every participant) passes ``receivers`` = number of clients that receive it."""
        m, p, b = message_size(message)
        self.add(round_, direction, p, b, m if receivers is None else receivers)

    def upload_params_per_client_per_round(self) -> float:
        """Average parameters one participating client uploads in one round (the unit of
        FedPCL Table 2's "# of Comm Params", but measured)."""
        return self.up_params / self.up_messages if self.up_messages else 0.0

    def summary(self) -> dict[str, float | int]:
        return {
            "upload_params_per_client_per_round": self.upload_params_per_client_per_round(),
            "upload_params_total": self.up_params,
            "download_params_total": self.down_params,
            "upload_bytes_total": self.up_bytes,
            "download_bytes_total": self.down_bytes,
            "rounds_communicating": len(self.rounds),
        }


def ledger_from_rounds(records: Any) -> CommLedger:
    """A ledger from an engine's round records (``fedheads.core.engine.RoundRecord``: each
    with ``round``, ``participants`` and ``comm.{up,down}_{values,bytes}`` summed over the
    round's participants). Duck-typed so this module does not import the core."""
    led = CommLedger()
    for rec in records:
        p = len(rec.participants)
        c = rec.comm
        led.rounds.add(int(rec.round))
        led.up_params += int(c.up_values)
        led.up_bytes += int(c.up_bytes)
        led.down_params += int(c.down_values)
        led.down_bytes += int(c.down_bytes)
        led.up_messages += p
    return led


# ------------------------------------------------------------------ FedPCL conventions


FEDPCL_TABLE2_METHODS = ("fedavg", "pfedme", "perfedavg", "fedrep", "fedproto", "fedpcl", "solo")


def method_key(method: str) -> str:
    """Case/punctuation-free method name: "Per-FedAvg" -> "perfedavg"."""
    return method.lower().replace("-", "").replace("_", "").replace(" ", "")


def fedpcl_trainable_params(arch: HeadArch) -> int:
    """FedPCL Table 14 "# of Training Params" (weights only): 512K x 256 projection plus
    256 x C (133,632 / 264,704 / 395,776 for K = 1, 2, 3). Table 14 is an experiment on
    FedPCL itself, which has no classifier, yet its count includes the 256 x C term (the
    size of the prototype set, or the baselines' classifier; the paper does not say): the
    convention is reproduced as printed. The measured count (``trainable_params_per_client``
    in results.json) comes from the actual tensors."""
    return arch.in_dim * arch.proj_dim + arch.proj_dim * arch.num_classes


_ALIASES = {"linearprobe": "lp", "fedavglinear": "fedavg-linear"}


def round_comm_of(method: Any, arch: HeadArch, clients: int) -> PaperRoundComm | None:
    """The papers' per-client round traffic by the algorithm's own convention
    (AlgorithmBase.paper_round_comm), None where it has none. `method`: a registered name (its
    default configuration) or a built algorithm (a run's own, so nothing is built again)."""
    if not isinstance(method, str):
        return method.paper_round_comm(arch, clients)
    from fedheads.algorithms import create_algorithm, list_algorithms

    key = method_key(method)
    names = {method_key(i.name): i.name for i in list_algorithms()}
    name = _ALIASES.get(key) or names.get(key)
    return create_algorithm(name).paper_round_comm(arch, clients) if name else None


def _convention(method: Any, arch: HeadArch, clients: int) -> PaperRoundComm:
    """round_comm_of, or one line naming the methods that have a convention."""
    from fedheads.algorithms import create_algorithm, list_algorithms

    rc = round_comm_of(method, arch, clients)
    if rc is None:
        names = {method_key(i.name): i.name for i in list_algorithms()}
        known = sorted(n for n in names.values() if create_algorithm(n).paper_round_comm(arch, clients) is not None)
        raise UserError(f"method={getattr(method, 'name', method)!r}: no paper convention (known: {', '.join(known)})")
    return rc


def fedpcl_comm_params(method: Any, arch: HeadArch) -> int:
    """FedPCL Table 2 "# of Comm Params": parameters one client sends per round, by the
    algorithm's own convention (its file's `paper_round_comm`)."""
    return _convention(method, arch, 1).upload


def paper_total_bytes(params_per_client_per_round: int, clients: int, rounds: int,
                      fraction: float = 1.0, bits: int = BITS_PER_PARAM) -> float:
    """Total bytes up and down when a client receives what it sends (FedNCM Appendix A,
    Eq. 3-4 structure): 2 * params * K * R * F * bits / 8. Not FedPCL's traffic: use
    :func:`paper_comm_bytes`, which knows each method's download."""
    _check_krf(clients, rounds, fraction)
    return 2.0 * params_per_client_per_round * clients * rounds * fraction * bits / 8.0


def _check_krf(clients: int, rounds: int, fraction: float) -> None:
    if not 0.0 < fraction <= 1.0:
        raise UserError(f"fraction={fraction}: must be in (0, 1]")
    if clients < 0 or rounds < 0:
        raise UserError("clients/rounds: must be >= 0")


def paper_round_comm(method: Any, arch: HeadArch, clients: int) -> PaperRoundComm:
    """Per-client, per-round upload and download of ``method`` with ``clients`` clients, as its
    algorithm file states its papers' convention (FedPCL: (m + 1) x C x d down, one silent
    round; every other method receives what it sends)."""
    return _convention(method, arch, clients)


def paper_comm_bytes(method: Any, arch: HeadArch, clients: int, rounds: int,
                     fraction: float = 1.0, bits: int = BITS_PER_PARAM) -> tuple[float, float]:
    """(upload, download) bytes over a run by the papers' convention (FedNCM Appendix A's
    K * R * F * 32 bit, per direction):

        upload   = U * K * R * F * bits / 8
        download = D * K * (R - silent_rounds) * F * bits / 8

    with U, D, silent_rounds from :func:`paper_round_comm`. FedPCL, 5 clients, 10 classes,
    d = 256, 50 rounds: U = 2,560, D = 6 x 2,560 = 15,360 -> 2.56 MB up + 15.0528 MB down =
    17.6128 MB. (The engine measures 17.64 MB for that run: each upload also carries the
    class counts (float32) and presence flags (bool), each download the sets' presence flags:
    250 x 50 B + 245 x 60 B more. The symmetric formula gives 5.12 MB.)"""
    _check_krf(clients, rounds, fraction)
    rc = paper_round_comm(method, arch, clients)
    per = clients * fraction * bits / 8.0
    return rc.upload * rounds * per, rc.download * max(0, rounds - rc.silent_rounds) * per


# ------------------------------------------------------------------ FedNCM conventions


def comm_lp_bytes(ll_in: int, ll_out: int, clients: int, rounds: int, fraction: float = 1.0,
                  bits: int = BITS_PER_PARAM, include_bias: bool = False) -> float:
    """FedNCM Eq. 3: 2 * (LL_out * LL_in) * K * R * F * 32 bit, in bytes (LP)."""
    lin = ll_in + (1 if include_bias else 0)
    return paper_total_bytes(ll_out * lin, clients, rounds, fraction, bits)


def comm_ft_bytes(ll_in: int, ll_out: int, base_params: int, clients: int, rounds: int,
                  fraction: float = 1.0, bits: int = BITS_PER_PARAM) -> float:
    """FedNCM Eq. 4: 2 * ((LL_out * LL_in) + P) * K * R * F * 32 bit, in bytes (FT)."""
    return paper_total_bytes(ll_out * ll_in + base_params, clients, rounds, fraction, bits)


def comm_fedncm_bytes(ll_in: int, ll_out: int, clients: int, bits: int = BITS_PER_PARAM) -> float:
    """FedNCM: Eq. 3 with one round and every client (Alg. 1 runs once over all clients),
    e.g. 10 classes x 512-d x 100 clients -> 4.096e6 bytes."""
    return comm_lp_bytes(ll_in, ll_out, clients, rounds=1, fraction=1.0, bits=bits)


def comm_fedncm_ft_bytes(ll_in: int, ll_out: int, base_params: int, clients: int, rounds: int,
                         fraction: float = 1.0, bits: int = BITS_PER_PARAM,
                         include_ncm_round: bool = False) -> float:
    """FedNCM+FT: Eq. 4 for the fine-tuning rounds. Table 2 prints the same figure as FT
    (the FedNCM round is left out as negligible: with it CUB would read 679.14, not
    679.06 GB); ``include_ncm_round=True`` adds the one FedNCM round."""
    ft = comm_ft_bytes(ll_in, ll_out, base_params, clients, rounds, fraction, bits)
    return ft + (comm_fedncm_bytes(ll_in, ll_out, clients, bits) if include_ncm_round else 0.0)


def comp_ft(rounds: int, epochs: int, n_samples: int) -> int:
    """FedNCM Eq. 5: 3 * R * E * N_s forward-pass units (forward + backward = 3F)."""
    return 3 * rounds * epochs * n_samples


def comp_lp(rounds: int, epochs: int, n_samples: int) -> int:
    """FedNCM Eq. 6: R * E * N_s (HeadTuning needs no backward pass through the base)."""
    return rounds * epochs * n_samples


def comp_fedncm(n_samples: int) -> int:
    """FedNCM: one forward pass over the training data (Sec. 4, "only one forward pass").
    Table 2 prints "1" in this column; we count the passes, N samples x 1 F."""
    return n_samples
