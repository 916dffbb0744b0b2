"""Training-free heads on real frozen features: FedNCM, Fed3R, FedCOF, CCVR, FedPFT and the newer
closed forms AFL, GH-OFL (its five heads) and FedCGS, each linear one also as the start of 10 rounds
of further training, and FedNCM, Fed3R, CCVR and FedPFT under differential privacy.

The claims come from FedCOF (Goswami et al., "Covariances for Free: Exploiting Mean Distributions
for Training-free Federated Learning", NeurIPS 2025, abstract): FedCOF improves on
class-mean methods (FedNCM) by 4-26 % at the same communication, is competitive with or better
than methods sending second-order statistics (Fed3R), and initialising from it before federated
fine-tuning or linear probing helps. Fed3R (Fanì et al., "Accelerating Heterogeneous Federated
Learning with Closed-form Classifiers", ICML 2024) reports Fed3R above FedNCM; CCVR (Luo et al.,
"No Fear of Heterogeneity", NeurIPS 2021) reports calibration above the FedAvg head it calibrates.
AFL (He et al., CVPR 2025) computes in one round the pooled least squares, whatever the partition;
GH-OFL (Turazza et al., ICLR 2026) refines its closed-form Gaussian heads with heads trained on
Fisher-space synthetic features; FedCGS (Guan et al., AAAI 2025) claims a one-shot head that deals
with non-IID data better than the one-shot methods before it (FedPFT among them).

None of those papers evaluates Office-Caltech-10 or EfficientNet-Lite features (FedCOF: CIFAR-100,
ImageNet-R, CUB-200, Stanford Cars, iNaturalist-Users-120K with SqueezeNet, MobileNetV2 and
ViT-B/16; Fed3R: Landmarks and iNaturalist), so no published number is put beside ours: the
report checks the papers' orderings (Claims) instead.

Data: Office-Caltech-10 (the real images) with EfficientNet-Lite0 (ImageNet) features, under
Dirichlet label skew over 100 clients (alpha 0.1, the split of FedNCM Sec. 4 and of FedCOF's
client_accumulate.py, the four domains pooled) and under feature shift (the four domains as four
clients, as the FedPCL experiments). Other backbones: `--backbone efficientnet-lite0=NAME`.
"""

from __future__ import annotations

from pipelines.spec import CACHE_FIRST, BackboneSet, Claim, DataRecipe, Experiment, Layout, Method, Point, ScaleSpec

PAPERS = {"FedCOF": "Goswami et al., \"Covariances for Free: Exploiting Mean Distributions for Training-free Federated "
                    "Learning\", NeurIPS 2025",
          "AFL": "He et al., \"AFL: A Single-Round Analytic Approach for Federated Learning with Pre-trained Models\", "
                 "CVPR 2025",
          "GH-OFL": "Turazza, Picone & Mamei, \"The Gaussian-Head OFL Family: One-Shot Federated Learning from Client "
                    "Global Statistics\", ICLR 2026",
          "FedCGS": "Guan, Zhou & Gu, \"Capture Global Feature Statistics for One-Shot Federated Learning\", AAAI 2025"}

LITE0 = BackboneSet("EfficientNet-Lite0 (ImageNet)", paper=("efficientnet-lite0",), standin=("efficientnet-lite0",),
                    note="the real EfficientNet-Lite0 ImageNet weights (224 px, 1280-d): no stand-in needed")

PARTITIONS = {
    "Dirichlet 0.1, 100 clients": DataRecipe(
        "office10", "label-shift", clients=100, alpha=0.1, train_fraction=0.8,
        note="FedNCM Sec. 4 / FedCOF client_accumulate.py: Dirichlet(0.1) over 100 clients, the four domains "
             "pooled; each client keeps 80 % of its samples for training and is tested on the rest"),
    "feature shift, 4 domains": DataRecipe(
        "office10", "feature-shift", train_fraction=0.8,
        note="one client per domain (Amazon, Caltech, DSLR, WebCam), 80 % of each domain for training"),
}

# every +FT row starts from its head (`fedheads finetune --head H`, round 0 = the head): at paper
# scale the whole backbone trains on live images; at ci/smoke the backbone's last stage and the head
# train cache-first on the stored maps of its last cut point but one ({cut}: blocks.6 for
# EfficientNet-Lite0), as FedNCM's ci rows; the +LP rows tune the head alone on the cached features
FT_ROUNDS = 10
LP_ROUNDS = 50  # FedAvg-LP under CCVR and the LP baseline (Sec. 4 of CCVR trains FedAvg first)

HEADS = (
    Method("FedNCM", "fedncm", paper_rounds=1, note="class means, cosine rule (FedNCM Alg. 1)"),
    Method("Fed3R", "fed3r", paper_rounds=1, note="ridge regression from summed Grams, lambda = 0.01 (Fed3R Eq. 4)"),
    Method("FedCOF", "fedcof", paper_rounds=1,
           note="class means only, covariances estimated from their spread (FedCOF Eq. 9-10)"),
    Method("FedAvg-LP", "lp", paper_rounds=LP_ROUNDS, note="the uncalibrated head CCVR starts from"),
    Method("CCVR (FedAvg-LP)", "ccvr", paper_rounds=LP_ROUNDS,
           note="FedAvg-LP of the same rounds, calibrated on virtual features (CCVR Sec. 4)"),
    Method("FedPFT", "fedpft", paper_rounds=1,
           note="one spherical Gaussian per class and client, server trains on synthetic features"),
    Method("AFL", "afl", paper_rounds=1,
           note="clients' regularised least squares, absolute aggregation and regularisation cleaning (gamma 1, "
                "run.sh): the pooled least squares; a singular system is solved with the pseudo-inverse (said)"),
)
GHOFL_HEADS = (("NB-diag", "nb"), ("LDA", "lda"), ("QDA", "qda"), ("FisherMix", "fishermix"),
               ("Proto-Hyper", "protohyper"))
GHOFL = tuple(Method(f"GH-OFL {lab}", "ghofl", settings=(("head", head),), paper_rounds=1,
                     note=f"GH-OFL's {lab} head (GH_OFL_server.py; the configs' shrinkage, Fisher and synthesis "
                          "settings)") for lab, head in GHOFL_HEADS)
FEDCGS = (Method("FedCGS", "fedcgs", paper_rounds=1,
                 note="Gaussian head with the global feature covariance (main_fedcgs.py, gamma 0; a singular "
                      "covariance solved with the pseudo-inverse, said)"),)
_LP_FROM = (("FedNCM", "fedncm"), ("Fed3R", "fed3r"), ("FedCOF", "fedcof"), ("AFL", "afl"), ("GH-OFL LDA", "ghofl"),
            ("FedCGS", "fedcgs"))
LP_FROM_HEAD = tuple(
    Method(f"{lab}+LP ({FT_ROUNDS} rounds, cached)", "lp", settings=(("init", alg),), paper_rounds=FT_ROUNDS + 1,
           scales=("smoke", "ci"),
           note=f"the cheapest faithful +FT: round 0 is {lab}'s head, then {FT_ROUNDS} FedAvg rounds of the linear "
                "head on the cached features (lp init)")
    for lab, alg in _LP_FROM) + (
    Method(f"CCVR (FedAvg-LP, {LP_ROUNDS}+{FT_ROUNDS} rounds)", "ccvr", paper_rounds=LP_ROUNDS + FT_ROUNDS,
           scales=("smoke", "ci"),
           note=f"CCVR's FedAvg-LP trained {FT_ROUNDS} rounds longer, calibrated after the last (lp cannot start "
                "from a calibrated head: CCVR is not a one-pass head)"),
    Method(f"FedPFT+LP ({FT_ROUNDS} rounds, cached)", "lp", settings=(("init", "fedpft"),),
           paper_rounds=FT_ROUNDS + 1, scales=("smoke", "ci"),
           requires=("missing:lp init=fedpft (FedPFT's head is trained at the server and exposes no linear_head "
                     "for lp to start from)",)),)
FT_FROM_HEAD = tuple(
    Method(f"{lab}+FT ({FT_ROUNDS} rounds)", alg, kind="finetune", paper_rounds=FT_ROUNDS, scales=("paper",),
           note=f"fedheads finetune --head {alg}: the whole backbone and the head fine-tuned from {lab}'s head "
                "(round 0 equals the head)")
    for lab, alg in _LP_FROM) + tuple(
    Method(f"{lab}+FT ({FT_ROUNDS} rounds)", alg, kind="finetune", paper_rounds=FT_ROUNDS, scales=("paper",),
           requires=(f"missing:fedheads finetune --head {alg} (its head is not a one-pass linear head)",))
    for lab, alg in (("CCVR", "ccvr"), ("FedPFT", "fedpft")))
FT_CACHED_LABEL = "{}+FT ({} rounds, last stage, cache-first)"
FT_CACHED = tuple(
    Method(FT_CACHED_LABEL.format(lab, FT_ROUNDS), alg, kind="finetune", settings=CACHE_FIRST,
           paper_rounds=FT_ROUNDS, scales=("smoke", "ci"),
           note=f"fedheads finetune --head {alg} --set trainable=after:<cut>: round 0 is {lab}'s head, then "
                f"{FT_ROUNDS} FedAvg rounds of the backbone's last stage and the head on the cached maps before it "
                "(the full-backbone +FT row is paper scale)")
    for lab, alg in _LP_FROM)

SCALES = (("smoke", ScaleSpec(rounds=2, seeds=(0,), test_per_class=5, eval_every=0)),  # plumbing only
          ("ci", ScaleSpec(rounds=None, seeds=(0, 1, 2), eval_every=0)),
          ("paper", ScaleSpec(eval_every=0)))
NOTES = (
    "No published value is placed beside ours: none of the papers evaluates Office-Caltech-10 or EfficientNet-Lite "
    "features (FedCOF: CIFAR-100, ImageNet-R, CUB-200, Stanford Cars, iNaturalist with SqueezeNet, MobileNetV2, "
    "ViT-B/16; Fed3R: Landmarks, iNaturalist). The claims check the papers' orderings instead.",
    "Acc is each client's accuracy on its own held-out 20 %, averaged over clients; Acc (pooled test) is the "
    "accuracy on all clients' test samples together, the closer reading of FedCOF's global test set.",
    f"'+LP ({FT_ROUNDS} rounds, cached)' rows (ci/smoke) tune the linear head from the training-free head on the cached "
    f"features; '+FT ({FT_ROUNDS} rounds, last stage, cache-first)' rows (ci/smoke) fine-tune the backbone's last stage "
    "and the head from it on the stored maps before that stage (`fedheads finetune --head H --set "
    f"trainable=after:<cut>`: blocks.6 of EfficientNet-Lite0, its 1x1 conv_head and BN); '+FT ({FT_ROUNDS} rounds)' "
    "rows (paper scale) fine-tune the whole backbone on live images. `fedheads finetune --head` serves the one-pass "
    "linear heads (FedNCM, Fed3R, FedCOF, AFL, GH-OFL's LDA, FedCGS); GH-OFL's rows start from its default LDA head.",
    "eval_every 0: only the last round is evaluated (the table reads it).",
    "The seeds vary training (LP's initialisation and batches, CCVR's and FedPFT's draws), not the partition (one "
    "fixed split per point, docs/contracts.md section 9): FedNCM, Fed3R and FedCOF are deterministic functions of "
    "the split, hence their std of 0.",
    "CCVR under label skew at 100 clients: its clients' full per-class second moments ([clients, C, D, D] float64, "
    "13 GB stacked) are added by the engine's summed path instead (the n-weighted FedAvg deltas and the class "
    "statistics summed group by group, ccvr.py summed_update), about 131 MB.",
    "GH-OFL: one cell per head (nb, lda, qda, fishermix, protohyper); each cell also reports the closed-form heads "
    "beside its own (results.json other_rules), and its clients send per-class second moments only where the head "
    "needs them (qda and the trained heads). FedCGS's personal rule (each client's own class prior) is its cells' "
    "'personal' rule.",
    "Other backbones (e.g. efficientnet-lite1 or efficientnet-lite2, registered with their ImageNet weights, or your "
    "own): `--backbone efficientnet-lite0=NAME`; docs/papers/training_free.md has the table on Lite1 and Lite2.",
)

_ALL = HEADS + GHOFL + FEDCGS + LP_FROM_HEAD + FT_CACHED + FT_FROM_HEAD
_POINTS = tuple(Point((("partition", k),), r, LITE0) for k, r in PARTITIONS.items())

FT_QUOTE = ("'using our method to initialize classifiers and then performing federated fine-tuning or linear probing "
            "again yields better performance' (FedCOF, abstract)")
TABLE = Experiment(
    name="training-free", title="Training-free heads on real features", paper="FedCOF", source="abstract (claims)",
    summary="FedNCM, Fed3R, FedCOF, CCVR (on FedAvg-LP), FedPFT, AFL, GH-OFL's five heads and FedCGS on "
            "Office-Caltech-10 EfficientNet-Lite0 features under label skew and feature shift, each linear head also "
            "followed by 10 rounds of training.",
    methods=_ALL, points=_POINTS,
    axes=(("partition", tuple(PARTITIONS)),), rounds=1, scales=SCALES,
    layout=Layout(rows=("partition", "method"), metrics=("acc", "acc_pooled"), figure="fairness"),
    claims=(
        Claim("FedCOF above FedNCM by 4-26 %", "FedCOF", over=("FedNCM",), magnitude=(4.0, 26.0),
              quote="'improves performance in the range of 4-26% with exactly the same communication cost when "
                    "compared to methods sharing only class means' (FedCOF, abstract)"),
        Claim("FedCOF at least as good as Fed3R", "FedCOF", over=("Fed3R",),
              quote="'competitive or superior to methods sharing second-order statistics' (FedCOF, abstract)"),
        Claim("Fed3R above FedNCM", "Fed3R", over=("FedNCM",)),
        Claim("CCVR above the FedAvg-LP head it calibrates", "CCVR (FedAvg-LP)", over=("FedAvg-LP",)),
        Claim("AFL in one round at least as good as FedAvg-LP's 50", "AFL", over=("FedAvg-LP",)),
        Claim("GH-OFL's Fisher-space heads above its closed-form LDA", "GH-OFL Proto-Hyper",
              over=("GH-OFL LDA",),
              quote="'The server reconstructs Gaussian decision heads analytically and optionally refines them in a "
                    "Fisher subspace' (GH-OFL README)"),
        Claim("GH-OFL's LDA above its naive Bayes", "GH-OFL LDA", over=("GH-OFL NB-diag",)),
        Claim("FedCGS above FedPFT (one-shot, non-IID)", "FedCGS", over=("FedPFT",),
              quote="'existing one-shot FL methods ... cannot deal with non-IID ... data stably and effectively' "
                    "(FedCGS, abstract)"),
        Claim("FedCOF+LP above FedNCM+LP", f"FedCOF+LP ({FT_ROUNDS} rounds, cached)",
              over=(f"FedNCM+LP ({FT_ROUNDS} rounds, cached)",),
              quote=FT_QUOTE),
        Claim("FedCOF+FT above FedNCM+FT (cache-first)", FT_CACHED_LABEL.format("FedCOF", FT_ROUNDS),
              over=(FT_CACHED_LABEL.format("FedNCM", FT_ROUNDS),),
              quote=FT_QUOTE),
    ),
    notes=NOTES,
)

# privacy-utility: FedNCM, Fed3R, CCVR and FedPFT under the Gaussian mechanism (fedheads.privacy), central
# noise (FedPFT: local), features normalised to unit norm, delta 1e-5, one release per client (one-shot heads)
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0)


def _dp(eps: float) -> tuple:
    return (("dp", (("epsilon", eps), ("delta", 1e-5), ("clip", 1.0), ("transform", "normalize"),
                    ("noise_seed", 0))),)


# under DP Fed3R's default ridge penalty follows the Gram's noise (lam_noise_scale = 2: lambda = 0.01 +
# 2 sigma sqrt(D'), the spectral scale of the noise); the fixed lambda = 0.01 row shows why it must
FED3R_FIXED = Method("Fed3R (lambda 0.01)", "fed3r", settings=(("lam_noise_scale", 0.0),), paper_rounds=1,
                     note="the paper's lambda = 0.01 kept fixed under DP")
# CCVR under DP calibrates a saved linear head (head=RUN_DIR; its FedAvg-LP deltas are no clipped sums):
# Fed3R's, trained in the same cell under the same mechanism (FedNCM's cosine rule is no linear head).
# Both releases are calibrated for two (releases=2): the calibrated head is (epsilon, 1e-5)-DP end to
# end at the point's epsilon (the cell's privacy_end_to_end; its privacy block is the calibration's own)
CCVR_DP = Method("CCVR (on DP Fed3R)", "ccvr", settings=(("head_from", "fed3r"), ("covariance", "paper"),
                                                         ("dp", (("releases", 2),))), paper_rounds=1,
                 note="Fed3R's head trained under DP in the same cell, then calibrated on virtual features from the "
                      "noisy class means and covariances (CCVR Sec. 4); the two releases share the point's epsilon")
# FedPFT's mixtures are no sums: each client noises its own class statistics (local DP, fedheads.privacy)
FEDPFT_DP = Method("FedPFT (local DP)", "fedpft", settings=(("dp", (("mode", "local"),)),), paper_rounds=1,
                   note="each client adds the Gaussian noise to its own per-class count, sum and sum of squares and "
                        "fits its spherical Gaussians to them (local DP: the server sees only noisy statistics)")
_DP_METHODS = HEADS[:2] + (FED3R_FIXED, CCVR_DP, FEDPFT_DP)
# CCVR runs under feature shift only, as in the table above (its [clients, C, D, D] second moments)
_DP_POINTS = tuple(Point((("partition", k), ("epsilon", e)), PARTITIONS[k], LITE0, settings=_dp(e),
                         methods=None if r.clients is None else tuple(m.label for m in _DP_METHODS if m is not CCVR_DP))
                   for k, r in PARTITIONS.items() for e in EPSILONS)
DP = Experiment(
    name="training-free-dp", title="Privacy-utility of the training-free heads", paper="FedCOF",
    source="(ours: no paper figure)",
    summary="FedNCM, Fed3R, CCVR (calibrating a DP Fed3R head) and FedPFT (local DP) under (epsilon, 1e-5)-DP: "
            "unit-norm features, Gaussian noise on the summed statistics (FedPFT: on each client's own), RDP "
            "accounting (fedheads.privacy); accuracy against epsilon.",
    methods=_DP_METHODS, points=_DP_POINTS, axes=(("partition", tuple(PARTITIONS)), ("epsilon", EPSILONS)),
    rounds=1, scales=SCALES,
    layout=Layout(rows=("partition", "method"), columns=("epsilon",), metrics=("acc",), figure="vs:epsilon"),
    notes=("Each point is one Gaussian mechanism per seed (a one-shot head releases its statistics once); the noise "
           "is drawn from a fixed key (noise_seed 0) so the run reproduces; a deployment draws a secret one.",
           "Without DP the same heads are the 'training-free' rows.",
           "Fed3R sets its ridge penalty from the noise under DP (lambda = 0.01 + 2 sigma sqrt(D'), sigma the noise std "
           "per entry of the 1281 x 1281 Gram, whose spectral norm is about 2 sigma sqrt(D)); 'Fed3R (lambda 0.01)' keeps "
           "the paper's penalty, with which the noisy system is indefinite (the solve falls back to the pseudo-inverse "
           "and says so).",
           "CCVR (on DP Fed3R): each cell trains Fed3R under the mechanism (saved as `fedheads train` saves it, its noise "
           "from another key) and calibrates that head with CCVR's class statistics under the same mechanism; both "
           "noise multipliers are calibrated for two releases, so the two compose to the point's epsilon (the cell's "
           "privacy_end_to_end; its privacy block is the calibration's alone, with the head's beside it). The head is "
           "noisier than the 'Fed3R' row's, which spends the whole epsilon. Under feature shift only (4 clients).",
           "FedPFT (local DP): each client noises its own statistics with the whole mechanism's noise (--dp-mode "
           "local), so the server combines one noise draw per client instead of one in all: the private guarantee "
           "holds against the server too, at that price.") + NOTES[1:2],
)

EXPERIMENTS = (TABLE, DP)
