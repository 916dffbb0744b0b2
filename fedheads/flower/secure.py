"""Secure aggregation of the sum-shaped server steps with Flower's SecAgg+ (contract 8b).

Which fields are sums (`secure_form`):
- FedNCM (and LP's FedNCM round): the per-class feature sums m_c^k and counts n_c^k (FedNCM
  Alg. 1 lines 7-12); the server only ever sees sum_k m_c^k and sum_k n_c^k.
- FedProto: the count-weighted prototypes w_ij C_i^(j) and weights w_ij.
- FedPCL (aggregation "weighted"): sum_i |D_ij| C_i^(j) and sum_i |D_ij| (Eq. 6). The local
  prototype sets themselves still travel in the clear: Eq. 7 sends every client's set to every
  client, so the server must hold them (see docs/contracts.md 8b for what that reveals).
The server step on the totals calls the algorithm's own `server_aggregate` on a one-row message
holding the totals: a server written as sums + finalize gives the same result for the rows or
for their sum (FedPCL: once with the clear rows and zero weights for its bank of local sets,
once with the totals and no participant rows).

Quantisation (public, the same for every node of a round; Flower's quantize/dequantize):
each node divides field f by 2^E_f, E_f = max over the round's nodes of ceil(log2 max|v_f|)
(each node reports only its exponent, in the clear), so |v| <= 1 = the clipping range; Flower
rounds (stochastically) to T = min(2^30, 2^(32 - ceil(log2(P + 1)))) levels over [-1, 1]
(P participants: the masked sum of P values stays below the modulus 2^32), all in float64.
The error of a securely summed entry is below  P * (2 / T) * 2^E_f  (each node's rounding
error is below one step) plus float64 rounding of Flower's dequantisation (|.| <= 2^-40 *
P * 2^E_f here), i.e. relative to the largest single contribution below 4 P / T (1.1e-8 for
P = 3). Integer fields (counts) are rounded back and are exact while 4 P max|v| / T < 0.5."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.core.protocol import RoundCtx

SECURE_ALGORITHMS = ("fedncm", "fedproto", "fedpcl")
CLIP = 1.0  # Flower's clipping range after our power-of-two prescaling


@dataclass(frozen=True)
class SecAggConfig:
    """SecAgg+ settings (Flower's SecAggPlusWorkflow arguments)."""

    shares: float = 1.0  # num_shares as a fraction of the round's participants (1.0 = all)
    threshold: float = 0.67  # reconstruction_threshold as a fraction of the shares (>= 2 kept)
    timeout: float = 120.0  # seconds each SecAgg+ stage waits for replies


def quantization_range(participants: int) -> int:
    """T: the masked sum of `participants` values in [0, T] (plus their weight factors) stays
    below the modulus 2^32, and T fits Flower's int32 rounding."""
    if participants < 2:
        raise UserError(f"secagg: needs at least 2 participants in a round, got {participants}")
    return min(1 << 30, 1 << (32 - math.ceil(math.log2(participants + 1))))


def exponent(t: torch.Tensor) -> int:
    """The smallest E with max|t| <= 2^E (0 for an all-zero or empty tensor)."""
    m = float(t.abs().max()) if t.numel() else 0.0
    return math.frexp(m)[1] if m > 0 else 0


def error_bound(participants: int, exp: int) -> float:
    """Bound on |secure sum - exact sum| of one entry of a field scaled by 2^exp."""
    return participants * (2.0 / quantization_range(participants)) * 2.0 ** exp + 2.0 ** -40 * participants * 2.0 ** exp


def scale_down(v: np.ndarray, exp: int) -> np.ndarray:
    """v / 2^exp in float64 (exact: a power of two)."""
    out = np.ldexp(np.asarray(v, dtype=np.float64), -exp)
    if out.size and float(np.abs(out).max()) > CLIP:
        raise UserError(f"secagg: a value exceeds the agreed scale 2^{exp} (data changed during the round?)")
    return out


@dataclass(frozen=True)
class SecureForm:
    """How one algorithm's message splits into secure sums and what stays in the clear."""

    sums: Callable[[Any, Any], dict[str, torch.Tensor]]  # (alg, msg) -> one client's contributions (no client axis)
    integer: tuple[str, ...]  # fields holding integers (rounded back after dequantisation)
    clear: Callable[[Any, Any], Any]  # (alg, msg) -> what still travels in the clear (None: nothing)
    aggregate: Callable[[Any, Any, Any, dict[str, torch.Tensor], RoundCtx], tuple[Any, Any]]
    # (alg, server_state, stacked clear messages or None, totals, ctx) -> (server_state, broadcast)


def _fedncm() -> SecureForm:
    from fedheads.algorithms.fedncm import FedNCMMessage

    def agg(alg: Any, ss: Any, clear: Any, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple[Any, Any]:
        msg = FedNCMMessage(tot["sums"].to(_sums_dtype(alg))[None], tot["counts"].round().to(torch.int64)[None])
        return alg.server_aggregate(ss, msg, ctx)

    return SecureForm(lambda a, m: {"sums": m.sums[0].double(), "counts": m.counts[0].double()}, ("counts",),
                      lambda a, m: None, agg)


def _sums_dtype(alg: Any) -> torch.dtype:
    return getattr(alg, "dtype", torch.float64)  # FedNCM's accumulation dtype; LP's FedNCM round is float64


def _fedproto() -> SecureForm:
    from fedheads.algorithms.fedproto import FedProtoMessage

    def agg(alg: Any, ss: Any, clear: Any, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple[Any, Any]:
        msg = FedProtoMessage(tot["weighted_protos"].float()[None], tot["weights"].round().float()[None])
        return alg.server_aggregate(ss, msg, ctx)

    return SecureForm(lambda a, m: {"weighted_protos": m.weighted_protos[0].double(), "weights": m.weights[0].double()},
                      ("weights",), lambda a, m: None, agg)


def _fedpcl() -> SecureForm:
    from fedheads.algorithms.fedpcl import FedPCLMessage

    def sums(alg: Any, m: Any) -> dict[str, torch.Tensor]:
        w = (m.counts * m.present)[0].double()  # Eq. 6 weights |D_ij| of the classes held
        return {"num": w.unsqueeze(-1) * m.protos[0].double(), "den": w}

    def clear(alg: Any, m: Any) -> Any:  # Eq. 7 needs every set; the counts stay secret
        return FedPCLMessage(m.protos, torch.zeros_like(m.counts), m.present)

    def agg(alg: Any, ss: Any, clear_msgs: Any, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple[Any, Any]:
        ss, _ = alg.server_aggregate(ss, clear_msgs, ctx)  # zero weights: only the bank of local sets
        den = tot["den"].round()
        mean = torch.where(den.unsqueeze(-1) > 0, tot["num"] / den.clamp_min(1).unsqueeze(-1), torch.zeros_like(tot["num"]))
        totals = FedPCLMessage(mean.float()[None], den.float()[None], (den > 0)[None])
        nobody = RoundCtx(ctx.round, ctx.seed, torch.empty(0, dtype=torch.int64), ctx.num_clients)
        return alg.server_aggregate(ss, totals, nobody)  # Eq. 6 on the totals, no bank row written

    return SecureForm(sums, ("den",), clear, agg)


def secure_form(alg: Any, msg: Any = None) -> SecureForm:
    """The form of `alg`'s messages (of `msg` when given: LP sends FedNCM sums in its first round)."""
    from fedheads.algorithms.fedncm import FedNCMMessage

    if alg.name == "fedncm" or isinstance(msg, FedNCMMessage):
        return _fedncm()
    if alg.name == "fedproto":
        return _fedproto()
    if alg.name == "fedpcl":
        agg = alg.cfg.agg
        if agg != "weighted":
            raise UserError(f"secagg: fedpcl aggregation {agg!r} is not a count-weighted sum "
                            "('mean' weights are public, 'eq6_literal' divides by the holders); use 'weighted'")
        return _fedpcl()
    raise UserError(f"secagg: {alg.name} has no secure form (SecAgg+ covers {', '.join(SECURE_ALGORITHMS)})")


def dequantized_totals(arrays: list[np.ndarray], names: list[str], exps: dict[str, int], integer: tuple[str, ...],
                       contributors: int) -> dict[str, torch.Tensor]:
    """Flower's SecAgg+ result (the MEAN over the `contributors`, scaled) -> the sums, in float64.
    Integer fields are rounded back; a field whose error bound reaches 0.5 is refused."""
    out: dict[str, torch.Tensor] = {}
    for name, arr in zip(names, arrays):
        total = np.ldexp(np.asarray(arr, dtype=np.float64) * contributors, exps[name])
        if name in integer:
            if error_bound(contributors, exps[name]) >= 0.5:
                raise UserError(f"secagg: {name} up to 2^{exps[name]} cannot be summed exactly with "
                                f"{contributors} participants")
            total = np.rint(total)
        out[name] = torch.from_numpy(total)
    return out


def secure_sums(grid: Any, context: Any, nodes: list[int], names: list[str], exps: dict[str, int],
                round_: int, cfg: SecAggConfig) -> tuple[list[np.ndarray] | None, list[int]]:
    """Run Flower's SecAggPlusWorkflow over `nodes` (their pending secure fields `names`, each
    scaled by 2^exps[name]); return (Flower's aggregate = the mean over the contributors, in the
    scaled units; the contributors' node ids). (None, []) when the protocol halted (too few
    nodes left for the reconstruction threshold)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow

    holder: dict[str, Any] = {}
    config = {"fields": ",".join(names), **{f"exp.{n}": int(exps[n]) for n in names}}
    legacy_ctx = Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                         state=RecordDict(), run_config=context.run_config)
    legacy_ctx.state.config_records["config"] = ConfigRecord({"current_round": round_ + 1})
    legacy_ctx.state.array_records["parameters"] = ArrayRecord()
    legacy = LegacyContext(legacy_ctx, strategy=_sum_strategy(nodes, config, holder))
    workflow = SecAggPlusWorkflow(num_shares=float(cfg.shares), reconstruction_threshold=float(cfg.threshold),
                                  max_weight=1.0, clipping_range=CLIP,
                                  quantization_range=quantization_range(len(nodes)), modulus_range=1 << 32,
                                  timeout=cfg.timeout)
    workflow(grid, legacy)
    return holder.get("arrays"), holder.get("nodes", [])


def _sum_strategy(nodes: list[int], config: dict[str, Any], holder: dict[str, Any]) -> Any:
    """The legacy Strategy SecAggPlusWorkflow drives: it names the round's nodes and receives
    the unmasked aggregate (it never sees a single node's vector)."""
    from flwr.common import FitIns, Parameters, parameters_to_ndarrays
    from flwr.server.client_proxy import ClientProxy
    from flwr.server.strategy import Strategy

    class NodeProxy(ClientProxy):
        def __init__(self, node_id: int) -> None:
            super().__init__(str(node_id))
            self.node_id = node_id

        def _unused(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError("the SecAgg+ workflow only reads node_id")

        get_properties = get_parameters = fit = evaluate = reconnect = _unused

    class SumStrategy(Strategy):
        def initialize_parameters(self, client_manager: Any) -> None:
            return None

        def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list:
            return [(NodeProxy(n), FitIns(Parameters(tensors=[], tensor_type=""), dict(config))) for n in nodes]

        def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
            if results:
                holder["arrays"] = parameters_to_ndarrays(results[0][1].parameters)
                holder["nodes"] = sorted(int(p.node_id) for p, _ in results)
            return None, {}

        def configure_evaluate(self, *a: Any) -> list:
            return []

        def aggregate_evaluate(self, *a: Any) -> tuple[None, dict]:
            return None, {}

        def evaluate(self, *a: Any) -> None:
            return None

    return SumStrategy()
