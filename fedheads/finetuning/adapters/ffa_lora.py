"""FFA-LoRA: Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning", ICLR
2024, Sec. 4: the randomly initialised factor A is frozen (never trained, never sent) and only the
zero-initialised B is trained by the clients and averaged. With A fixed and shared the update is
linear in B, so the average is exact: s (sum_k p_k B_k) A = sum_k p_k s B_k A (Sec. 4, "exact
aggregation"), and the upload is half of LoRA's factors (B only, plus the head).

A is drawn once from the run's seed (peft's kaiming-uniform initialisation, as the FedSA-LoRA
authors' FFA-LoRA baseline does: peft's default init with A frozen); every client derives the same
A from that seed, so it is never broadcast. The paper shows that with A fixed, alpha only rescales
B's learning rate (Sec. 4), so alpha is kept at the family default and the client lr is the knob.
"""

from __future__ import annotations

from fedheads.finetuning.adapters.base import AdapterFT


class FFALoRA(AdapterFT):
    name = "ffa-lora"
    summary = "FFA-LoRA: A frozen at its random initialisation; only B trained, sent and averaged (exact)"
    trains = ("B",)
    shared = ("B",)
