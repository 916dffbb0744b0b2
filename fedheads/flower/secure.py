"""Secure aggregation of the sum-shaped server steps with Flower's SecAgg+ (contract 8b).

Which fields are sums is declared by each algorithm in its own file (`secure_form`, a typed
hook of fedheads.core.protocol.AlgorithmBase): FedNCM's class sums and counts, FedProto's
count-weighted prototypes, FedPCL's Eq. 6 sums (its local sets still travel in the clear; see
docs/contracts.md 8b). The server step on the totals calls the algorithm's own
`server_aggregate` on a one-row message holding the totals: a server written as sums + finalize
gives the same result for the rows or for their sum.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.core.protocol import SecureForm

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


def secure_form(alg: Any, msg: Any = None) -> SecureForm:
    """The form of `alg`'s messages (of `msg` when given), declared in the algorithm's own file
    (AlgorithmBase.secure_form); an algorithm without one is refused there in one line."""
    return alg.secure_form(msg)


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
