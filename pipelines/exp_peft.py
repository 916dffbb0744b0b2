"""Parameter-efficient federated fine-tuning from a FedNCM head: LoRA under FedAvg (FedIT),
FFA-LoRA, FedSA-LoRA and FLoRA against fine-tuning the same stages, on real images and weights.

Claims, each from its paper's abstract:
- FFA-LoRA (Sun et al., "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024):
  freezing A halves the upload at no loss of accuracy, and is better than LoRA under DP noise.
- FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning",
  ICLR 2025): keeping B (and the head) local learns client-specific knowledge: a personalised gain
  over aggregating both factors under heterogeneous data.
- FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
  Low-Rank Adaptations", NeurIPS 2024): stacking aggregates exactly and beats FedIT's
  averaging of the factors, also with heterogeneous ranks.

None of the papers uses images (GLUE, LLM instruction tuning), so no published number is put
beside ours; the report checks the directions (Claims) and says how large each difference is.

Data: Office-Caltech-10 (the real images) with EfficientNet-Lite0 (ImageNet), Dirichlet 0.1 label
skew over 100 clients (FedNCM Sec. 4) and feature shift (4 domains as 4 clients), as the
training-free experiment. At ci scale everything after blocks.5 trains cache-first: the maps after
blocks.5 (192 x 7 x 7) come from the store, and the adapters sit on blocks.6's pointwise
convolutions and conv_head (the family default, fedheads.finetuning.lora); FT trains those stages
whole. Paper scale adapts the whole backbone live (`trainable=all`, declared for a GPU).
"""

from __future__ import annotations

from pipelines import exp_training_free
from pipelines.spec import Claim, Experiment, Layout, Method, Point, ScaleSpec

PAPERS = {"FFA-LoRA": "Sun, Li, Li & Ding, \"Improving LoRA in Privacy-preserving Federated Learning\", ICLR 2024",
          "FedSA-LoRA": "Guo et al., \"Selective Aggregation for Low-Rank Adaptation in Federated Learning\", ICLR 2025",
          "FLoRA": "Wang et al., \"FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank "
                   "Adaptations\", NeurIPS 2024",
          "FedIT": "Zhang et al., \"Towards Building the Federated GPT: Federated Instruction Tuning\", ICASSP 2024"}

# the training-free experiment's backbone and partitions (the same manifests and stores)
LITE0, PARTITIONS = exp_training_free.LITE0, exp_training_free.PARTITIONS
CUT = "blocks.5"  # ci: blocks.6 and the features stage train (or carry the adapters) on the cached maps after it
ROUNDS = 10
EPSILON = 8.0  # client-level (epsilon, 1e-5)-DP over the run's rounds
DP = (("dp_epsilon", EPSILON), ("dp_clip", 0.05))
MIXED = "4,8,16"


def _ft(label: str, adapter: str = "none", settings: tuple = (), note: str = "") -> Method:
    return Method(label, "fedncm", kind="finetune", settings=(("adapter", adapter),) + settings,
                  paper_rounds=ROUNDS, note=note)


FEDNCM = Method("FedNCM", "fedncm", paper_rounds=1, note="the stage-1 head every other row starts from (round 0)")
FT = _ft("FedNCM+FT", note="blocks.6 and the features stage trained whole (ci: after blocks.5, cache-first)")
LORA = _ft("FedNCM+LoRA", "lora", note="FedIT: A and B averaged separately (rank 8, alpha 16)")
FFA = _ft("FedNCM+FFA-LoRA", "ffa-lora", note="A frozen at its random initialisation, B alone trained and sent")
FEDSA = _ft("FedNCM+FedSA-LoRA", "fedsa-lora", note="A averaged; B and the head kept by each client (evaluated so)")
FLORA = _ft("FedNCM+FLoRA", "flora", note="factors stacked, the exact product merged into the weights every round")
FLORA_MIXED = _ft(f"FedNCM+FLoRA (ranks {MIXED})", "flora", (("ranks", MIXED),),
                  note=f"client i has rank ({MIXED})[i mod 3], alpha / r kept at 2")
LORA_DP = _ft(f"FedNCM+LoRA (DP, eps {EPSILON:g})", "lora", DP,
              note=f"client-level ({EPSILON:g}, 1e-5)-DP: updates clipped to 0.05, Gaussian noise on their sum")
FFA_DP = _ft(f"FedNCM+FFA-LoRA (DP, eps {EPSILON:g})", "ffa-lora", DP,
             note=f"client-level ({EPSILON:g}, 1e-5)-DP: updates clipped to 0.05, Gaussian noise on their sum")
METHODS = (FEDNCM, FT, LORA, FFA, FEDSA, FLORA, FLORA_MIXED, LORA_DP, FFA_DP)

SCALES = (("smoke", ScaleSpec(rounds=2, seeds=(0,), test_per_class=5, eval_every=1,
                              settings=(("trainable", f"after:{CUT}"),))),
          ("ci", ScaleSpec(rounds=ROUNDS, seeds=(0, 1, 2), eval_every=1, settings=(("trainable", f"after:{CUT}"),))),
          ("paper", ScaleSpec(eval_every=1, settings=(("trainable", "all"),))))
NOTES = (
    "No published value is placed beside ours: the adapter papers fine-tune language models (GLUE, instruction "
    "tuning), not image backbones. The claims check their directions; the report gives each margin.",
    f"ci and smoke: cache-first after {CUT} (the maps after it read from the store): FT trains blocks.6 and the "
    "features stage (conv_head, BN) and the head; the adapters sit on blocks.6's conv_pw and conv_pwl and on "
    "conv_head (EfficientNet-Lite's default targets), everything else frozen. Paper scale adapts (or trains) the "
    "whole backbone on live images, for a GPU.",
    "Bytes are measured: what each message holds (factors, head change, the weight n_k), per client and round; "
    "FFA-LoRA never sends A (every client derives it from the run's seed), FedSA-LoRA never sends B or the head, "
    "FLoRA's download is the previous round's stack (growing with the participants).",
    f"DP rows: client-level ({EPSILON:g}, 1e-5)-DP over the {ROUNDS} rounds (RDP, no amplification by sampling "
    "claimed), each client's update of the shared tensors clipped to L2 0.05 and counted with weight 1; FFA-LoRA's "
    "paper states its DP claim for DP-SGD (example-level), ours is the client-level mechanism the issue asks for.",
    "FedSA-LoRA's accuracy is each client's own model (shared A, its own B and head) on its own test set.",
)
_PERSONAL = "Dirichlet 0.1, 100 clients"
TABLE = Experiment(
    name="peft", title="Parameter-efficient federated fine-tuning (the LoRA family)", paper="FFA-LoRA",
    source="abstracts (claims)",
    summary="FedNCM, FedNCM+FT and FedNCM + LoRA (FedIT), FFA-LoRA, FedSA-LoRA and FLoRA (also with mixed ranks) "
            "on Office-Caltech-10 with EfficientNet-Lite0, under label skew and feature shift, with accuracy, values "
            "sent per client and seconds per round; LoRA and FFA-LoRA also under client-level DP.",
    # DP rows under label skew only: with 4 clients the noise on their sum (std z C per entry) drowns 4 clipped
    # updates whatever the method
    methods=METHODS, points=tuple(Point((("partition", k),), r, LITE0,
                                        methods=None if r.clients else tuple(m.label for m in METHODS[:-2]))
                                  for k, r in PARTITIONS.items()),
    axes=(("partition", tuple(PARTITIONS)),), rounds=ROUNDS, scales=SCALES,
    layout=Layout(rows=("partition", "method"), metrics=("acc", "up_values", "comm_GB", "round_s"), figure="curves"),
    claims=(
        Claim("FFA-LoRA at least LoRA's accuracy at half its upload", "FedNCM+FFA-LoRA", over=("FedNCM+LoRA",),
              quote="'FFA-LoRA ... halves the communication cost' with 'better and more stable performance' "
                    "(FFA-LoRA, abstract)"),
        Claim("FFA-LoRA above LoRA under DP at the same epsilon", FFA_DP.label, over=(LORA_DP.label,),
              quote="'the noise amplification effect when adopting differentially private stochastic gradient "
                    "descent' on LoRA (FFA-LoRA, abstract)"),
        Claim("FedSA-LoRA's personalised models above LoRA under label skew", "FedNCM+FedSA-LoRA",
              over=("FedNCM+LoRA",), where=(("partition", _PERSONAL),),
              quote="'A matrices ... learn general knowledge, while B matrices ... capture client-specific knowledge' "
                    "(FedSA-LoRA, abstract)"),
        Claim("FLoRA above FedIT (exact aggregation)", "FedNCM+FLoRA", over=("FedNCM+LoRA",),
              quote="'FLoRA ... noise-free aggregation ... FLoRA outperforms ... state-of-the-art methods' (FLoRA, "
                    "abstract)"),
        Claim("FLoRA with mixed ranks above FedIT", f"FedNCM+FLoRA (ranks {MIXED})", over=("FedNCM+LoRA",),
              quote="'seamlessly supports heterogeneous LoRA adapters' (FLoRA, abstract)"),
        Claim("Any adapter above the FedNCM head it starts from", "FedNCM+FFA-LoRA", over=("FedNCM",)),
    ),
    notes=NOTES,
)

EXPERIMENTS = (TABLE,)
