"""FedSA-LoRA: Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning",
ICLR 2025, Sec. 4 (Alg. 1): the A factors learn what clients share and are sent and averaged;
the B factors learn what is client-specific and stay with each client (never sent). The head
stays with each client too, as in the authors' GLUE configuration
(`personalization.local_param: ['lora_B', 'classifier']`).

Every client starts from the stage-1 head and B = 0 and keeps its own B (and head) across the
rounds it takes part in; evaluation is per client with its own B and head (a client that never
trained is evaluated with the shared A, B = 0 and the stage-1 head: the starting model).
"""

from __future__ import annotations

from fedheads.finetuning.adapters.base import AdapterFT


class FedSALoRA(AdapterFT):
    name = "fedsa-lora"
    summary = "FedSA-LoRA: A shared and averaged; B (and the head) kept by each client, evaluated per client"
    trains = ("A", "B")
    shared = ("A",)
    local_head = True
