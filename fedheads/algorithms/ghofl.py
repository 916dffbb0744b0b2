"""GH-OFL (Turazza, Picone & Mamei, "The Gaussian-Head OFL Family: One-Shot Federated Learning from
Client Global Statistics", ICLR 2026; arXiv 2602.01186) on cached features: one round, each client
sends sums of its features' moments, the server builds Gaussian classifiers from them in closed
form and, optionally, trains one of two small heads on synthetic features. The details follow the
authors' camera-ready code (FabioTur-dev/One-Shot-FL client/run_client.py, server/GH_OFL_server.py
and the settings of configs/cifar100.yaml and configs/svhn.yaml), cited below by function; the
paper itself was not at hand, so where the repository's README describes the trained heads
otherwise (a cosine FisherMix, a Proto-Hyper on standardised LDA logits with a QDA teacher) the
server's code is what runs here.

Client k (``aggregate_client_stats_x``) sends, per class c it holds, A_kc = Σ x, Q_kc = Σ x ⊙ x and
n_kc; its B_k = Σ xxᵀ over all its rows; and, when the head needs them (QDA, and the trained heads'
class-covariance synthesis), S_kc = Σ xxᵀ per class. All are sums over examples. The server adds
them (``aggregate_clients_x``) and forms, with N_c = Σ_k n_kc, N = Σ_c N_c and the C classes,

    μ_c = A_c / N_c,   log π_c = log max(N_c / N, 1e-12)
    v_c = max(Q_c / N_c − μ_c², 1e-6)                          (diagonal variances)
    Σ = (B − Σ_c N_c μ_c μ_cᵀ) / max(1, N − C)                 (pooled within-class covariance)
    Σ_c = (S_c − N_c μ_c μ_cᵀ) / (N_c − 1), or Σ where N_c <= 1 (class covariances)

and the heads (``logits_nbdiag_cpu``, ``logits_lda_cpu``, ``QDAFullFastGPU``), with the shrinkage
shrink(S, α) = (1 − α) S + α tr(S)/D I (``shrink_cov``) and ε = 1e-6:

    nb:  log π_c − ½ Σ_d (x_d − μ_cd)² / v_cd − ½ Σ_d log v_cd
    lda: x·w_c + b_c,  w_c = Σ_α⁻¹ μ_c,  b_c = −½ μ_cᵀ w_c + log π_c,  Σ_α = shrink(Σ, lda_shrink) + 2εI
         (the code adds εI when it shrinks and again in logits_lda_cpu)
    qda: log π_c − ½ ||L_c⁻¹ (x − μ_c)||² − Σ log diag L_c,  L_c L_cᵀ = shrink(Σ_c, qda_shrink) + εI

The trained heads (``fisher_subspace``, ``synthesize_fisher``, ``train_fishermix``,
``train_protohyper``) live in the Fisher subspace z = xV: with the priors π, the between-class
scatter S_B = Σ_c π_c (μ_c − μ̄)(μ_c − μ̄)ᵀ and S_W = shrink(Σ, lda_shrink) + εI, the eigenvectors
U of S_W^-½ S_B S_W^-½ (descending) give V = S_W^-½ U_K, K the fewest reaching `fisher_energy` of
the eigenvalues' sum, clipped to [2, fisher_max_dim]. Per class, `syn_per_class` features
z ~ N(μ_c V, τ² (Vᵀ shrink(Σ_c, syn_shrink) V + εI) + εI) are drawn (class covariances, or Σ
without them); ``fishermix`` is a linear head on z trained with AdamW and the cross-entropy;
``protohyper`` adds a low-rank residual z U_r V_r + b (rank `ph_rank`) to a spherical naive Bayes
in z-space (variance tr(VᵀΣ_αV)/K) and is trained with AdamW on α_kd T² KL(teacher ‖ student) +
(1 − α_kd) CE, the teacher blending the z-space LDA and that naive Bayes (`teacher_blend`).

Decisions stated: the draws are counter-based in (seed, class, row) (core/rng.py) and the batches'
order keyed by the seed, so both engines and every device draw the same (the authors' use the
global torch generator); each eigenvector's sign is fixed (its largest entry positive), which
the subspace leaves free; classes no client holds get no synthetic features (the code draws
features of the zero mean for them) and are never predicted (-inf; the code gives them log
1e-12 and the zero mean); the closed-form heads are computed in float64 (the code's QDA runs in
float32 on the GPU). Under differential privacy the noisy covariances are projected onto the
positive semidefinite cone before the shrinkage (post-processing), so every solve stays defined.

Messages. Without SecAgg+ each client sends only the classes it holds: per class its A, Q, label
and count (2D + 2 values) and S (D²) where sent, plus B (D²); the bytes counted are those
(class_items.ClassItems). Under SecAgg+ every field is a sum and is masked dense (C(2D + 1) +
D² + C D² values); DP noises every field (sensitivities of one example with ||x|| <= clip: A by
clip, Q by ||x ⊙ x|| <= clip², n by 1, B and S by ||xxᵀ||_F = clip²), so the whole message, and all
five heads, are covered. The papers' convention (`paper_round_comm`) counts the dense message.
Partial participation works as FedNCM's: a client sends once, the server re-finalises from the
running sums, and the trained heads are a pure function of those sums and the seed, so the head
after every client has been seen is the one-round head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from embedcache.errors import UserError
from fedheads.algorithms.ccvr import fit_linear, shuffled
from fedheads.algorithms.class_items import ClassItems, ClassTotals, class_items, pooled_totals
from fedheads.algorithms.fed3r import linear_head
from fedheads.algorithms.pfl_common import config_from_kwargs
from fedheads.core import rng
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm

HEADS = ("nb", "lda", "qda", "fishermix", "protohyper")
TRAINED = ("fishermix", "protohyper")
EPS = 1e-6  # MIN_EPS of GH_OFL_server.py
LOG_FLOOR = math.log(1e-12)  # the prior of a class no client holds (pri.clamp_min(1e-12))
SRC = "GH_OFL_server.py"


@dataclass(frozen=True)
class GHOFLConfig:
    """GH-OFL settings: the values of the camera-ready configs (configs/cifar100.yaml and
    configs/svhn.yaml agree on all of them; GH_OFL_server.py's own defaults differ where noted)."""

    head: str = setting("lda", "the head that predicts: nb | lda | qda (closed form) | fishermix | protohyper "
                        "(trained on synthetic features); nb and lda (and qda where class covariances are sent) "
                        "are reported beside it", source="GH_OFL_server.py evaluate_streaming")
    class_covariances: bool | None = setting(None, "clients send per-class second moments S_kc (C D^2 values "
                                             "each); None: where the head needs them (qda; the trained heads "
                                             "with syn_class_cov)", source="run_client.py S_per_class_x")
    lda_shrink: float = setting(0.05, "shrinkage alpha of the pooled covariance (LDA, and the Fisher subspace)",
                                source="configs lda_shrink")
    qda_shrink: float = setting(0.1, "shrinkage alpha of each class covariance (QDA)",
                                source="configs qda_shrink (server default 0.05)")
    fisher_energy: float = setting(0.995, "share of the Fisher eigenvalues' sum the subspace keeps",
                                   source="configs fisher_energy (server default 0.99)")
    fisher_max_dim: int = setting(128, "largest Fisher subspace dimension K", source="configs/cifar100.yaml")
    syn_per_class: int = setting(4000, "synthetic features drawn per class", source="configs syn_ns_per_class")
    syn_tau: float = setting(0.9, "scale tau of the synthetic features' spread (clipped to [0.6, 1.4])",
                             source="configs syn_tau_base, syn_tau_clip")
    syn_shrink: float = setting(0.05, "shrinkage of the covariances the synthetic features are drawn from",
                                source="configs syn_shrink")
    syn_class_cov: bool = setting(True, "draw from each class's covariance (False: the pooled one)",
                                  source="configs syn_use_class_cov")
    fm_epochs: int = setting(40, "FisherMix epochs", source="configs fm_epochs")
    fm_batch: int = setting(2048, "FisherMix batch size", source="configs fm_batch")
    fm_lr: float = setting(8e-4, "FisherMix AdamW learning rate", source="configs fm_lr")
    fm_wd: float = setting(3e-4, "FisherMix AdamW weight decay", source="configs fm_wd")
    ph_epochs: int = setting(40, "Proto-Hyper epochs", source="configs ph_epochs")
    ph_batch: int = setting(1024, "Proto-Hyper batch size", source="configs ph_batch")
    ph_lr: float = setting(1e-3, "Proto-Hyper AdamW learning rate", source="configs ph_lr")
    ph_wd: float = setting(5e-4, "Proto-Hyper AdamW weight decay", source="configs ph_wd")
    ph_rank: int = setting(128, "rank of Proto-Hyper's residual (at most K)", source="configs ph_rank")
    kd_alpha: float = setting(0.4, "weight of the distillation term in Proto-Hyper's loss",
                              source="configs kd_alpha (server default 0.85)")
    kd_temperature: float = setting(4.0, "distillation temperature T", source="configs kd_T")
    teacher_blend: float = setting(0.7, "the teacher's weight on the z-space LDA (the rest on the naive Bayes)",
                                   source="configs teacher_blend")

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise UserError(f"head {self.head!r}: must be one of {', '.join(HEADS)}")
        for name in ("lda_shrink", "qda_shrink", "syn_shrink", "kd_alpha", "teacher_blend"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"{name} {getattr(self, name)}: must be in [0, 1]")
        if not 0.0 < self.fisher_energy <= 1.0:
            raise UserError(f"fisher_energy {self.fisher_energy}: must be in (0, 1]")
        for name in ("fisher_max_dim", "syn_per_class", "fm_epochs", "fm_batch", "ph_epochs", "ph_batch", "ph_rank"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} {getattr(self, name)}: must be >= 1")
        for name in ("fm_lr", "ph_lr", "kd_temperature", "syn_tau"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} {getattr(self, name)}: must be > 0")
        if self.head == "qda" and self.class_covariances is False:
            raise UserError("head qda needs the class covariances: drop class_covariances=false")

    @property
    def sends_class_covariances(self) -> bool:
        if self.class_covariances is not None:
            return self.class_covariances
        return self.head == "qda" or (self.head in TRAINED and self.syn_class_cov)


@dataclass(frozen=True)
class GHOFLClientState:
    sent: torch.Tensor  # [M] bool: this client's statistics have reached the server


@dataclass(frozen=True)
class GHOFLServerState:
    sums: torch.Tensor  # [C, D] float64 A = sum_k A_kc
    sumsq: torch.Tensor  # [C, D] float64 Q = sum_k Q_kc
    counts: torch.Tensor  # [C] int64 N_c
    gram: torch.Tensor  # [D, D] float64 B = sum_k B_k
    class_sq: torch.Tensor  # [C', D, D] float64 S_c (C' = 0 where class covariances are not sent)
    present: torch.Tensor  # [C] bool N_c >= 1
    mean: torch.Tensor  # [C, D] float64 mu_c
    log_prior: torch.Tensor  # [C] float64 log pi_c
    var: torch.Tensor  # [C, D] float64 v_c (nb)
    lda_weight: torch.Tensor  # [D, C] float64 w_c
    lda_bias: torch.Tensor  # [C] float64 b_c
    qda_factor: torch.Tensor  # [C', D, D] float64 L_c^-1
    qda_bias: torch.Tensor  # [C'] float64 log pi_c - sum log diag L_c
    fisher: torch.Tensor  # [D, K] float64 V (K = 0 unless a trained head)
    z_mean: torch.Tensor  # [C, K] float64 mu_c V (Proto-Hyper's naive Bayes)
    z_var: torch.Tensor  # [] float64 its spherical variance
    z_weight: torch.Tensor  # [K, C] float32 FisherMix's weight, or Proto-Hyper's residual U_r V_r
    z_bias: torch.Tensor  # [C] float32 its bias


@dataclass(frozen=True)
class GHOFLBroadcast:
    """Nothing: one round, the clients need nothing from the server."""


# ---------------------------------------------------------------------- the server's closed forms
def _sym(s: torch.Tensor) -> torch.Tensor:
    return 0.5 * (s + s.transpose(-1, -2))


def shrink(s: torch.Tensor, alpha: float) -> torch.Tensor:
    """(1 - alpha) S + alpha tr(S)/D I of symmetric S [..., D, D] (shrink_cov; tr clamped at 0)."""
    s = _sym(s)
    D = s.shape[-1]
    tr = s.diagonal(dim1=-2, dim2=-1).sum(-1).clamp(min=0.0)
    eye = torch.eye(D, dtype=s.dtype, device=s.device)
    return (1.0 - alpha) * s + alpha * (tr / max(1, D))[..., None, None] * eye


def _psd(s: torch.Tensor) -> torch.Tensor:
    """The nearest positive semidefinite matrix in Frobenius norm (eigenvalues clipped at 0; Higham 1988)."""
    lam, vec = torch.linalg.eigh(_sym(s))
    return (vec * lam.clamp(min=0).unsqueeze(-2)) @ vec.transpose(-1, -2)


def _eye(D: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(D, dtype=like.dtype, device=like.device)


@dataclass(frozen=True)
class Moments:
    """The aggregated statistics' Gaussians (aggregate_clients_x)."""

    present: torch.Tensor
    mean: torch.Tensor
    prior: torch.Tensor  # [C] pi_c, clamped at 1e-12
    var: torch.Tensor
    pooled: torch.Tensor  # [D, D] Sigma
    class_cov: torch.Tensor | None  # [C, D, D] Sigma_c


def moments(sums: torch.Tensor, sumsq: torch.Tensor, counts: torch.Tensor, gram: torch.Tensor,
            class_sq: torch.Tensor | None, noisy: bool = False) -> Moments:
    """aggregate_clients_x's estimates from the summed statistics (module docstring); with `noisy`
    (DP totals) the covariances are projected onto the PSD cone."""
    C, D = sums.shape
    n = counts.clamp(min=0).to(torch.float64)
    N = float(n.sum())
    mean = sums / n.clamp(min=1).unsqueeze(1)
    prior = (n / max(1.0, N)).clamp(min=1e-12)
    var = (sumsq / n.clamp(min=1).unsqueeze(1) - mean * mean).clamp(min=1e-6)
    within = gram - (mean * n.unsqueeze(1)).T @ mean  # B - sum_c N_c mu_c mu_c^T
    pooled = _sym(within / max(1.0, N - C))
    if noisy:
        pooled = _psd(pooled)
    cov = None
    if class_sq is not None and class_sq.shape[0]:
        outer = n.view(-1, 1, 1) * mean.unsqueeze(2) * mean.unsqueeze(1)
        cov = (class_sq - outer) / (n - 1).clamp(min=1).view(-1, 1, 1)
        cov = _sym(torch.where((n > 1).view(-1, 1, 1), cov, pooled.expand(C, D, D)))
        if noisy:
            cov = _psd(cov)
    return Moments(counts >= 1, mean, prior, var, pooled, cov)


def lda(m: Moments, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [D, C], b [C]) of the LDA head (logits_lda_cpu after main's shrinkage)."""
    D = m.pooled.shape[0]
    s = _sym(shrink(m.pooled, alpha)) + 2 * EPS * _eye(D, m.pooled)
    w = torch.linalg.solve(s, m.mean.T)  # Sigma_alpha^-1 mu_c
    return w, -0.5 * (m.mean * w.T).sum(1) + torch.log(m.prior)


def qda(m: Moments, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_c^-1 [C, D, D], log pi_c - sum log diag L_c [C]) of the QDA head (QDAFullFastGPU)."""
    assert m.class_cov is not None
    D = m.pooled.shape[0]
    chol = torch.linalg.cholesky(_sym(shrink(m.class_cov, alpha)) + EPS * _eye(D, m.pooled))
    inv = torch.linalg.solve_triangular(chol, _eye(D, m.pooled).expand_as(chol), upper=False)
    return inv, torch.log(m.prior) - torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1)


def fisher_subspace(m: Moments, alpha: float, energy: float, max_k: int) -> torch.Tensor:
    """V [D, K] (fisher_subspace), each column's sign fixed by its largest entry of U."""
    C, D = m.mean.shape
    mbar = (m.prior.unsqueeze(1) * m.mean).sum(0, keepdim=True)
    dm = m.mean - mbar
    sb = _sym((dm * m.prior.unsqueeze(1)).T @ dm)  # S_B = sum_c pi_c (mu_c - mu)(mu_c - mu)^T
    sw = _sym(shrink(m.pooled, alpha)) + EPS * _eye(D, m.pooled)
    lam_w, vec_w = torch.linalg.eigh(sw)  # invsqrt_psd
    w_invsqrt = (vec_w * lam_w.clamp(min=1e-12).rsqrt().unsqueeze(0)) @ vec_w.T
    lam, u = torch.linalg.eigh(_sym(w_invsqrt @ sb @ w_invsqrt))
    lam = lam.clamp(min=0)
    order = torch.argsort(lam, descending=True)
    lam, u = lam[order], u[:, order]
    if float(lam.sum()) <= 0:
        return _eye(D, m.pooled)[:, :min(2, D)].contiguous()
    share = torch.cumsum(lam, 0) / max(float(lam.sum()), 1e-12)
    k = int((share >= energy).nonzero()[0]) + 1
    k = max(2, min(k, max_k, D))
    u = u[:, :k]
    sign = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))
    return (w_invsqrt @ (u * sign)).contiguous()


def synthesis_factors(m: Moments, v: torch.Tensor, shrink_alpha: float, tau: float, class_cov: bool) -> torch.Tensor:
    """[C, K, K] factors L_c of the synthetic features' covariance in z-space (synthesize_fisher)."""
    K = v.shape[1]
    tau = max(0.6, min(1.4, float(tau)))
    cov = m.class_cov if class_cov and m.class_cov is not None else m.pooled.unsqueeze(0)
    sf = _sym(v.T @ _sym(shrink(cov, shrink_alpha)) @ v) + EPS * _eye(K, v)
    chol = torch.linalg.cholesky(tau * tau * sf + EPS * _eye(K, v))
    return chol.expand(m.mean.shape[0], K, K)


def draws(seed: int, c: int, n: int, k: int, device: torch.device) -> torch.Tensor:
    """[n, k] standard normals of class c, keyed by (seed, c, row, column)."""
    j = torch.arange(n, device=device).view(-1, 1)
    return rng.normal(seed, 0x6805, c, j, torch.arange(k, device=device).view(1, -1)).to(device)


def synthetic(m: Moments, v: torch.Tensor, factors: torch.Tensor, per_class: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(z [n, K] float32, labels [n]): `per_class` draws mu_c V + eps L_c^T for each class held."""
    mz = m.mean @ v
    zs, ys = [], []
    for c in m.present.nonzero().view(-1).tolist():
        eps = draws(seed, c, per_class, v.shape[1], v.device)
        zs.append((mz[c].unsqueeze(0) + eps @ factors[c].T).to(torch.float32))
        ys.append(torch.full((per_class,), c, dtype=torch.int64, device=v.device))
    if not zs:
        return v.new_zeros(0, v.shape[1], dtype=torch.float32), torch.zeros(0, dtype=torch.int64, device=v.device)
    return torch.cat(zs), torch.cat(ys)


@dataclass(frozen=True)
class ZGaussians:
    """build_gaussians_fisher: the z-space LDA (W, b) and spherical naive Bayes (mu, sigma^2)."""

    mean: torch.Tensor  # [C, K] float64
    log_prior: torch.Tensor  # [C] float64
    var: float
    lda_w: torch.Tensor  # [K, C] float64
    lda_b: torch.Tensor  # [C] float64


def z_gaussians(m: Moments, v: torch.Tensor, alpha: float) -> ZGaussians:
    K = v.shape[1]
    sig = _sym(v.T @ shrink(m.pooled, alpha) @ v) + EPS * _eye(K, v)
    mz = m.mean @ v
    w = torch.linalg.solve(_sym(sig) + EPS * _eye(K, v), mz.T)  # lda_scores_f
    log_prior = torch.log(m.prior)
    return ZGaussians(mz, log_prior, max(float(torch.trace(sig)) / max(1, K), 1e-12), w,
                      -0.5 * (mz * w.T).sum(1) + log_prior)


def nb_z(z: torch.Tensor, mean: torch.Tensor, log_prior: torch.Tensor, var: float) -> torch.Tensor:
    """nb_scores_f, in float32 as the code: log pi_c - ||z - mu_c||^2 / (2 sigma^2) - K/2 log sigma^2."""
    z = z.to(torch.float32)
    mu, lp = mean.to(torch.float32), log_prior.to(torch.float32)
    quad = 0.5 * ((z * z).sum(-1, keepdim=True) - 2.0 * z @ mu.T + (mu * mu).sum(1)) / var
    return lp - quad - 0.5 * mu.shape[1] * math.log(var + 1e-12)


def lda_z(z: torch.Tensor, g: ZGaussians) -> torch.Tensor:
    return (z.to(torch.float64) @ g.lda_w + g.lda_b).to(torch.float32)


def uniform_init(shape: tuple[int, ...], fan_in: int, *key: int, device: torch.device) -> torch.Tensor:
    """nn.Linear's initial distribution, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), keyed (float32)."""
    idx = torch.arange(math.prod(shape), device=device)
    u = rng.uniform(*key, idx).to(device).view(shape)
    return ((2.0 * u - 1.0) / math.sqrt(fan_in)).to(torch.float32)


def kd_mix_loss(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, alpha: float, T: float) -> torch.Tensor:
    """alpha T^2 KL(softmax(teacher/T) || softmax(student/T)) + (1 - alpha) CE (kd_mix_loss)."""
    ce = torch.nn.functional.cross_entropy(student, y)
    if alpha <= 0:
        return ce
    kl = torch.nn.functional.kl_div(torch.log_softmax(student / T, 1), torch.softmax(teacher / T, 1).detach(),
                                    reduction="batchmean")
    return alpha * T * T * kl + (1.0 - alpha) * ce


def train_protohyper(z: torch.Tensor, y: torch.Tensor, g: ZGaussians, params: dict[str, torch.Tensor],
                     cfg: GHOFLConfig, key: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """train_protohyper: the residual {"u": [K, r], "v": [r, C], "b": [C]} trained with AdamW on the
    distillation mix; student = nb_z + z u v + b, teacher = blend lda_z + (1 - blend) nb_z."""
    ps = {k: t.detach().clone().requires_grad_(True) for k, t in params.items()}
    opt = torch.optim.AdamW(list(ps.values()), lr=cfg.ph_lr, weight_decay=cfg.ph_wd)
    w, n = float(cfg.teacher_blend), z.shape[0]
    with torch.enable_grad():
        for e in range(cfg.ph_epochs):
            perm = shuffled(n, *key, e, device=z.device)
            for a in range(0, n, cfg.ph_batch):
                zb, yb = z[perm[a:a + cfg.ph_batch]], y[perm[a:a + cfg.ph_batch]]
                with torch.no_grad():
                    base = nb_z(zb, g.mean, g.log_prior, g.var)
                    teacher = w * lda_z(zb, g) + (1.0 - w) * base
                student = base + (zb @ ps["u"]) @ ps["v"] + ps["b"]
                loss = kd_mix_loss(student, teacher, yb, cfg.kd_alpha, cfg.kd_temperature)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return {k: t.detach() for k, t in ps.items()}


class GHOFL(AlgorithmBase):
    """GH-OFL in the core's algorithm protocol (one pass: every client sends its statistics once)."""

    name = "ghofl"
    description = ("GH-OFL (Turazza et al. ICLR 2026): Gaussian heads (naive Bayes, LDA, QDA) from summed "
                   "client statistics, and heads trained on Fisher-space synthetic features")
    config = GHOFLConfig
    global_rule = "main"
    one_pass = True
    sums_messages = True  # the server reads only the sums over clients
    clamp_noisy_counts = False  # presence is decided on the running total of the noisy counts
    server_sized_fields = ("fisher", "z_mean", "z_weight")  # K follows the Fisher spectrum

    def __init__(self, cfg: GHOFLConfig = GHOFLConfig()) -> None:
        self.cfg = cfg
        self.full = cfg.sends_class_covariances
        self.seed_free = cfg.head not in TRAINED  # the trained heads draw synthetic features from the seed
        self.moments = ("sums", "sumsq", "class_sq") if self.full else ("sums", "sumsq")
        self.num_classes: int | None = None  # set by init: the secure form makes a client's classes dense

    def init(self, spec: DataSpec, seed: int) -> Init:
        M, D, C, dev = spec.num_clients, spec.dim, spec.num_classes, spec.device
        Cs = C if self.full else 0
        self.num_classes = C

        def f64(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=dev)

        ss = GHOFLServerState(f64(C, D), f64(C, D), torch.zeros(C, dtype=torch.int64, device=dev), f64(D, D),
                              f64(Cs, D, D), torch.zeros(C, dtype=torch.bool, device=dev), f64(C, D), f64(C),
                              f64(C, D), f64(D, C), f64(C), f64(Cs, D, D), f64(Cs), f64(D, 0), f64(C, 0), f64(),
                              torch.zeros(0, C, device=dev), torch.zeros(C, device=dev))
        return Init(GHOFLClientState(torch.zeros(M, dtype=torch.bool, device=dev)), ss, GHOFLBroadcast())

    def client_update(self, cs: GHOFLClientState, bc: GHOFLBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[GHOFLClientState, ClassItems]:
        """aggregate_client_stats_x, once per client: its classes' A, Q, n (and S), and B."""
        fresh = ~cs.sent.to(data.m_train.device)
        msg = class_items(data.x_train, data.y_train, data.m_train & fresh.view(-1, 1), data.num_classes, self.moments,
                          fresh)
        return GHOFLClientState(torch.ones_like(cs.sent)), msg

    def summed_update(self, cs: GHOFLClientState, bc: GHOFLBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[GHOFLClientState, ClassTotals]:
        """The sums over the clients in `data` as one row, from their rows pooled (no per-client
        B or S is made)."""
        fresh = ~cs.sent.to(data.m_train.device)
        tot = pooled_totals(data.x_train, data.y_train, data.m_train & fresh.view(-1, 1), data.num_classes,
                            self.moments, fresh)
        return GHOFLClientState(torch.ones_like(cs.sent)), tot

    def server_aggregate(self, ss: GHOFLServerState, msg: ClassItems | ClassTotals,
                         ctx: RoundCtx) -> tuple[GHOFLServerState, GHOFLBroadcast]:
        t = msg if isinstance(msg, ClassTotals) else msg.totals(ss.sums.shape[0])
        sq = t.items["class_sq"][0] if self.full else ss.class_sq
        return self._absorb(ss, t.items["sums"][0], t.items["sumsq"][0], t.counts[0], t.whole["gram"][0], sq,
                            int(t.clients.sum()), ctx)

    def _absorb(self, ss: GHOFLServerState, sums: torch.Tensor, sumsq: torch.Tensor, counts: torch.Tensor,
                gram: torch.Tensor, class_sq: torch.Tensor, clients: int,
                ctx: RoundCtx) -> tuple[GHOFLServerState, GHOFLBroadcast]:
        if clients == 0:  # nothing new: the heads stay as they are
            return ss, GHOFLBroadcast()
        dev = ss.sums.device
        sums, sumsq = ss.sums + sums.to(dev, torch.float64), ss.sumsq + sumsq.to(dev, torch.float64)  # sums ...
        counts, gram = ss.counts + counts.to(dev, torch.int64), ss.gram + gram.to(dev, torch.float64)
        class_sq = ss.class_sq + class_sq.to(dev, torch.float64) if self.full else ss.class_sq
        noisy = any(float(v) > 0 for v in (ctx.noise_std or {}).values())
        return self._finalize(sums, sumsq, counts, gram, class_sq, ctx.seed, noisy), GHOFLBroadcast()  # ... finalize

    def _finalize(self, sums: torch.Tensor, sumsq: torch.Tensor, counts: torch.Tensor, gram: torch.Tensor,
                  class_sq: torch.Tensor, seed: int, noisy: bool) -> GHOFLServerState:
        cfg, (C, D) = self.cfg, sums.shape
        m = moments(sums, sumsq, counts, gram, class_sq if self.full else None, noisy)
        w, b = lda(m, cfg.lda_shrink)
        qf, qb = qda(m, cfg.qda_shrink) if m.class_cov is not None else (class_sq, class_sq.new_zeros(0))
        v = sums.new_zeros(D, 0)
        z_mean, z_var = sums.new_zeros(C, 0), sums.new_zeros(())
        z_w, z_b = torch.zeros(0, C, device=sums.device), torch.zeros(C, device=sums.device)
        if cfg.head in TRAINED and bool(m.present.any()):
            v, g, z_w, z_b = self._trained(m, seed)
            z_mean, z_var = g.mean, torch.tensor(g.var, dtype=torch.float64, device=sums.device)
        return GHOFLServerState(sums, sumsq, counts, gram, class_sq, m.present, m.mean, torch.log(m.prior), m.var, w, b,
                                qf, qb, v, z_mean, z_var, z_w, z_b)

    def _trained(self, m: Moments, seed: int) -> tuple[torch.Tensor, ZGaussians, torch.Tensor, torch.Tensor]:
        """V, the z-space Gaussians and the trained head's (weight [K, C], bias [C])."""
        cfg, dev = self.cfg, m.mean.device
        C = m.mean.shape[0]
        v = fisher_subspace(m, cfg.lda_shrink, cfg.fisher_energy, cfg.fisher_max_dim)
        K = v.shape[1]
        factors = synthesis_factors(m, v, cfg.syn_shrink, cfg.syn_tau, cfg.syn_class_cov)
        z, y = synthetic(m, v, factors, cfg.syn_per_class, seed)
        g = z_gaussians(m, v, cfg.lda_shrink)
        if cfg.head == "fishermix":  # train_fishermix: nn.Linear(K, C), AdamW, cross-entropy
            head = {"cls.weight": uniform_init((K, C), K, seed, 0xF1, device=dev),
                    "cls.bias": uniform_init((C,), K, seed, 0xF2, device=dev)}
            out = fit_linear(head, z, y, optimizer="adamw", lr=cfg.fm_lr, weight_decay=cfg.fm_wd, epochs=cfg.fm_epochs,
                             batch_size=cfg.fm_batch, key=(seed, 0xF3))
            return v, g, out["cls.weight"], out["cls.bias"]
        r = min(cfg.ph_rank, K)  # ProtoHyperResidual: U = Linear(K, r, no bias), V = Linear(r, C)
        params = {"u": uniform_init((K, r), K, seed, 0xB1, device=dev), "v": uniform_init((r, C), r, seed, 0xB2, device=dev),
                  "b": uniform_init((C,), r, seed, 0xB3, device=dev)}
        out = train_protohyper(z, y, g, params, cfg, (seed, 0xB4))
        return v, g, out["u"] @ out["v"], out["b"]

    def predict(self, cs: GHOFLClientState, ss: GHOFLServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if not bool(ss.present.any()):
            raise UserError("ghofl: no statistics yet (run at least one round)")
        x64 = x.to(torch.float64)
        inv_var = 1.0 / ss.var
        nb = (ss.log_prior - 0.5 * ((x64 * x64) @ inv_var.T - 2.0 * x64 @ (ss.mean * inv_var).T
                                    + (ss.mean * ss.mean * inv_var).sum(1)) - 0.5 * torch.log(ss.var).sum(1))
        out = {"nb": nb, "lda": x64 @ ss.lda_weight + ss.lda_bias}
        if ss.qda_factor.shape[0]:
            out["qda"] = torch.stack([ss.qda_bias[c] - 0.5 * ((x64 - ss.mean[c]) @ ss.qda_factor[c].T).square().sum(-1)
                                      for c in range(ss.mean.shape[0])], -1)
        if ss.fisher.shape[1] and self.cfg.head in TRAINED:
            z = (x64 @ ss.fisher).to(torch.float32)
            s = z @ ss.z_weight + ss.z_bias
            if self.cfg.head == "protohyper":
                s = nb_z(z, ss.z_mean, ss.log_prior, float(ss.z_var)) + s
            out[self.cfg.head] = s
        absent = ~ss.present.to(x.device)
        out = {k: s.masked_fill(absent, float("-inf")) for k, s in out.items()}
        return {"main": out[self.cfg.head], **out}

    def linear_head(self, ss: GHOFLServerState) -> dict[str, torch.Tensor] | None:
        """The LDA head (GH-LDA+FT), or the trained head composed with V (a class no client holds
        keeps the code's zero mean and log 1e-12 prior); nb and qda are not linear in x."""
        if self.cfg.head == "lda":
            return linear_head(ss.lda_weight.T, ss.lda_bias)
        if self.cfg.head == "fishermix":
            return linear_head((ss.fisher @ ss.z_weight.double()).T, ss.z_bias.double())
        if self.cfg.head == "protohyper":  # nb_z less its ||z||^2 term (the same for every class)
            w = ss.z_mean.T / float(ss.z_var) + ss.z_weight.double()
            b = ss.log_prior - 0.5 * (ss.z_mean * ss.z_mean).sum(1) / float(ss.z_var) + ss.z_bias.double()
            return linear_head((ss.fisher @ w).T, b)
        return None

    def trained_notes(self, ss: GHOFLServerState, classes: list[str]) -> list[str]:
        if not bool(ss.present.any()):
            raise UserError("ghofl: no client sent statistics (run at least one round)")
        missing = [classes[c] if c < len(classes) else str(c) for c in (~ss.present).nonzero().view(-1).tolist()]
        if not missing:
            return []
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return [f"ghofl: no client holds class(es) {shown}: the heads never predict them"]

    def secure_form(self, message: object = None) -> SecureForm:
        """Under SecAgg+ the server sees the dense totals A, Q, N, B (and S) and the number of
        clients that sent: every field is a sum over examples."""

        def sums(m: ClassItems) -> dict[str, torch.Tensor]:
            if self.num_classes is None:
                raise UserError("ghofl: secure_form's sums need the number of classes, which init sets")
            t = m.totals(self.num_classes)
            return {**{k: v[0] for k, v in t.items.items()}, "counts": t.counts[0].double(), "gram": t.whole["gram"][0],
                    "clients": t.clients.double()}

        def agg(ss: GHOFLServerState, clear: object, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple:
            sq = _sym(tot["class_sq"]) if self.full else ss.class_sq[:0]
            return self._absorb(ss, tot["sums"], tot["sumsq"], tot["counts"].round().to(torch.int64), _sym(tot["gram"]),
                                sq, int(tot["clients"].round().sum()), ctx)

        return SecureForm(sums, ("counts", "clients"), lambda m: None, agg)

    def dp_sensitivity(self, clip: float) -> dict[str, float]:
        """One example, clipped to ||x|| <= clip, moves A_c by x (clip), Q_c by x ⊙ x (||.|| <= clip²),
        N_c by 1, B and S_c by xxᵀ (||.||_F = clip²); the number of clients is public."""
        c = float(clip)
        out = {"sums": c, "sumsq": c * c, "counts": 1.0, "gram": c * c, "clients": 0.0}
        if self.full:
            out["class_sq"] = c * c
        return out

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """Up: the dense statistics of run_client.py, C(2D + 1) + D² (+ C D² with S); down: nothing."""
        D, C = arch.in_dim, arch.num_classes
        return PaperRoundComm(C * (2 * D + 1) + D * D + (C * D * D if self.full else 0), 0)

    def trainable_params(self, cs: GHOFLClientState) -> int:
        return 0  # the clients train nothing (the trained heads are the server's, on synthetic features)


def _factory(**kw: object) -> GHOFL:
    return GHOFL(config_from_kwargs(GHOFLConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("ghofl", _factory, description=GHOFL.description, config=GHOFL.config)
