"""FLoRA: Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
Low-Rank Adaptations", NeurIPS 2024, Sec. 3 (stacking-based aggregation, Eq. 4-5): every round
each client k trains fresh adapters of its own rank r_k (A_k random, B_k = 0) on its copy of the
weights and sends A_k and B_k; the server stacks them,

    A = [p_1 A_1; p_2 A_2; ...; p_K A_K]   (rows),   B = [B_1, B_2, ..., B_K]   (columns),

with p_k = n_k / N, so that s B A = sum_k p_k s B_k A_k exactly, whatever the ranks (the
average of the clients' products, not FedIT's product of averages); the stacked factors are
broadcast and every client merges s B A into its weights, W <- W + s B A, and re-initialises its
adapters (the authors' code: p_k on A, `merge_and_unload`, fresh `get_peft_model` each round).
s = alpha / r is the same for every rank (the authors' alpha_k = 2 r_k).

Sums form: client k's factors fill its own slot of the stack (slots in the order the clients'
messages are added: the round's participants in order), so the stack is a sum of zero-padded
contributions, A-slot scaled by n_k; finalize divides A by N. Under secure aggregation each
client's vector would be the whole stack with only its slot non-zero.

Communication per round: upload r_k (d_in + d_out) per layer plus the head change; download the
stacked factors of the previous round (sum_k r_k (d_in + d_out) per layer, growing with the
number of participants) plus the head. The merged weights are state every client holds, never
sent.
"""

from __future__ import annotations

import torch

from fedheads.algorithms.pfl_common import DeltaMessage, GlobalModel
from fedheads.core.protocol import RoundCtx
from fedheads.finetuning.adapters.base import AdapterFT, AdapterState, AdapterSums
from fedheads.finetuning.model import LiveNet, Params


class FLoRA(AdapterFT):
    name = "flora"
    summary = "FLoRA: the clients' factors (heterogeneous ranks) stacked; their exact product merged into the weights"
    trains = ("A", "B")
    shared = ()  # the factors are new every round: sent as values and stacked, not averaged
    personalised = False  # type: ignore[assignment]
    dp_supported = False

    def local_keys(self) -> list[str]:
        return []  # nothing stays with a client: its factors are merged into everyone's weights

    def start_model(self, net: LiveNet) -> GlobalModel:
        start = super().start_model(net)  # the head
        base = {f"base:{n}": layer.base.weight.detach().clone() for n, layer in self.layers.items()}
        return GlobalModel(start.params, base)

    def stats_init(self) -> Params:
        return {"stack_values": torch.zeros((), dtype=torch.int64)}

    def prepare(self, net: LiveNet, bc: GlobalModel, ctx: RoundCtx, client: int) -> None:
        """Load the merged weights and head, then fresh adapters of this client's rank (A from
        torch's generator, which the driver seeds by (seed, round, client))."""
        self.load(net, bc)
        r = self.acfg.client_rank(client)
        s = self.acfg.alpha / self.acfg.rank
        for layer in self.layers.values():
            layer.reset(r, alpha=s * r)

    def message(self, bc: GlobalModel, net: LiveNet, n_train: int) -> DeltaMessage:
        """The head's change plus this client's factors A_k, B_k (values: they start afresh)."""
        msg = super().message(bc, net, n_train)
        now = self.read(net)
        factors = {self.key(n, f): now[self.key(n, f)].clone().unsqueeze(0) for n in self.layers for f in ("A", "B")}
        return DeltaMessage({**msg.delta, **factors}, {}, msg.weight)

    def extra_init(self, ss: AdapterState, ctx: RoundCtx | None) -> Params:
        """Zero stacks sized for the round's participants (slots in participant order)."""
        parts = [] if ctx is None else [int(i) for i in ctx.participants]
        total = sum(self.acfg.client_rank(i) for i in parts)
        out: Params = {"filled": torch.zeros((), dtype=torch.int64)}
        for n, layer in self.layers.items():
            w = layer.base.weight
            out[f"A:{n}"] = torch.zeros((total, layer.in_dim, *w.shape[2:]), dtype=torch.float64, device=w.device)
            out[f"B:{n}"] = torch.zeros((layer.out_dim, total, *([1, 1] if w.dim() == 4 else [])),
                                        dtype=torch.float64, device=w.device)
        return out

    def extra_add(self, sums: AdapterSums, msg: DeltaMessage) -> None:
        """Client k's slot: n_k A_k into the A stack, B_k into the B stack."""
        for j in range(msg.weight.shape[0]):
            at = int(sums.extra["filled"])
            r = 0
            for n in self.layers:
                A, B = msg.delta[self.key(n, "A")][j], msg.delta[self.key(n, "B")][j]
                r = A.shape[0]
                sums.extra[f"A:{n}"][at:at + r].add_(float(msg.weight[j]) * A.double())
                sums.extra[f"B:{n}"][:, at:at + r].add_(B.double())
            sums.extra["filled"].add_(r)

    def finalize_extra(self, ss: AdapterState, sums: AdapterSums, params: Params) -> tuple[Params, Params]:
        """A /= N; W <- W + s B A (Eq. 5: the stacked product merged into the weights)."""
        n = float(sums.weight)
        s = self.acfg.alpha / self.acfg.rank
        buffers = dict(ss.model.buffers)
        values = 0
        for name, layer in self.layers.items():
            A, B = sums.extra[f"A:{name}"] / n, sums.extra[f"B:{name}"]
            W = buffers[f"base:{name}"]
            buffers[f"base:{name}"] = (W.double() + layer.delta_weight(A, B, scale=s)).to(W.dtype)
            values += int(A.numel() + B.numel())
        return buffers, {"stack_values": torch.tensor(values, dtype=torch.int64)}

    def down_size(self, ss: AdapterState) -> tuple[int, int]:
        v, b = super().down_size(ss)  # the head
        stack = int(ss.stats["stack_values"])
        return v + stack, b + 4 * stack  # float32 factors

