"""LoRA under FedAvg (FedIT): Zhang et al., "Towards Building the Federated GPT: Federated
Instruction Tuning", ICASSP 2024, Sec. 3 (Alg. 1): clients train both LoRA factors A and B from
the broadcast adapters; the server averages A and B separately, weighted by the clients' data
sizes (the authors' `fed_utils/model_aggregation.py`), and broadcasts them (not re-initialised).

The average of products is not the product of averages: the global adapter's update is
s Bbar Abar, while the clients' mean update is sum_k p_k s B_k A_k (p_k = n_k / N). The gap is
measured every round and recorded as `aggregation_gap`: ||mean_k(s B_k A_k) - s Bbar Abar||_F
relative to ||mean_k(s B_k A_k) - s B A||_F (the round's ideal update), over every adapted layer
(Abar, Bbar are the plain weighted means, before any server optimiser). FFA-LoRA and FLoRA are
exact by construction.

Upload and download per client and round: A and B of every adapted layer and the head.
"""

from __future__ import annotations

import torch

from fedheads.algorithms.pfl_common import DeltaMessage
from fedheads.finetuning.adapters.base import AdapterFT, AdapterState, AdapterSums
from fedheads.finetuning.model import Params


class FedIT(AdapterFT):
    name = "lora"
    summary = "LoRA under FedAvg (FedIT): A and B trained by every client and averaged separately"
    trains = ("A", "B")
    shared = ("A", "B")

    def stats_init(self) -> Params:
        return {"aggregation_gap": torch.zeros((), dtype=torch.float64)}

    def extra_init(self, ss: AdapterState, ctx) -> Params:
        """The broadcast factors (the clients' deltas are relative to them) and sum_k n_k s B_k A_k."""
        out: Params = {}
        for n, layer in self.layers.items():
            out[f"prod:{n}"] = torch.zeros_like(layer.base.weight, dtype=torch.float64)
            for f in ("A", "B"):
                out[f"bc:{self.key(n, f)}"] = ss.model.params[self.key(n, f)]
        return out

    def extra_add(self, sums: AdapterSums, msg: DeltaMessage) -> None:
        """sum_k n_k s B_k A_k (the clients' factors are the broadcast plus their change)."""
        for n, layer in self.layers.items():
            ka, kb = self.key(n, "A"), self.key(n, "B")
            dA, dB = msg.delta[ka], msg.delta[kb]
            for j in range(dA.shape[0]):
                A, B = sums.extra[f"bc:{ka}"] + dA[j], sums.extra[f"bc:{kb}"] + dB[j]
                sums.extra[f"prod:{n}"].add_(float(msg.weight[j]) * layer.delta_weight(A.double(), B.double()))

    def finalize_extra(self, ss: AdapterState, sums: AdapterSums, params: Params) -> tuple[Params, Params]:
        n = float(sums.weight)
        num = den = 0.0
        for name, layer in self.layers.items():
            ka, kb = self.key(name, "A"), self.key(name, "B")
            A0, B0 = ss.model.params[ka].double(), ss.model.params[kb].double()
            Abar, Bbar = A0 + sums.delta[ka].double() / n, B0 + sums.delta[kb].double() / n
            ideal = sums.extra[f"prod:{name}"] / n
            num += float(((ideal - layer.delta_weight(Abar, Bbar)) ** 2).sum())
            den += float(((ideal - layer.delta_weight(A0, B0)) ** 2).sum())
        gap = (num ** 0.5) / (den ** 0.5) if den > 0 else 0.0
        return dict(ss.model.buffers), {"aggregation_gap": torch.tensor(gap, dtype=torch.float64)}
