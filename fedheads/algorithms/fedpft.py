"""FedPFT (Beitollahi et al., "Parametric Feature Transfer: One-shot Federated Learning with
Foundation Models", TMLR 2025; arXiv 2402.01862) on cached features: clients send per-class
Gaussian mixtures of their features, the server trains a classifier head on synthetic features
drawn from them. The details follow the authors' Flower baseline (adap/flower baselines/fedpft,
strategy.py and utils.py), cited below by function.

Client k fits, for every class c it holds, a Gaussian mixture of K = ``components`` components
to its features of that class (scikit-learn's GaussianMixture, EM; covariance ``"spherical"``,
``"diag"``, ``"full"`` or ``"tied"``) and sends the mixture's weights pi, means m and
covariances S with its count n_kc (utils.learn_gmm). The server draws n_kc synthetic features
from each received mixture (component j ~ Cat(pi), z = m_j + A_j eps with A_j A_j^T = S_j; eps
and the component draw are counter-based in (seed, client id, c, row): core/rng.py) and trains
the linear head on the pooled synthetic features centrally (strategy.FedPFT.aggregate_fit). One
round with every client (one-shot FL).

Differential privacy: the paper's own DP variant is not implemented here (the paper is not at
hand). Ours is a local Gaussian mechanism on each client's class statistics, in the style of
Analyze Gauss (Dwork et al., STOC 2014): with one Gaussian per class (``components=1``), a
client's per-class count n_kc, sum s_kc and second moment q_kc = sum x x^T are its mixture's
sufficient statistics, and one example with ||x|| <= C moves them by 1, C and C^2 (CCVR's
sensitivities). The "diag" and "spherical" types read only q's diagonal, sum x * x, which one
example moves by ||x * x|| <= ||x||^2 <= C^2 too: they send and noise that [C, D] diagonal, not
the [C, D, D] matrix. Under ``--dp-mode local`` (fedheads.privacy) each client adds the Gaussian noise
to its own (n, s, q) and fits its Gaussians to the noisy ones (`local_form`: post-processing):
ñ = round(n + noise), a class sent where ñ > 1 as FedPFT's rule, mean s/ñ and the maximum-
likelihood covariance q/ñ - mu mu^T with scikit-learn's reg_covar 1e-6 added to its diagonal
(what EM returns for one component, so vanishing noise gives the non-private mixtures), its
negative eigenvalues clipped to 0 for the "full" and "tied" types (the nearest positive
semidefinite matrix, Higham 1988) and its diagonal to >= reg_covar for "diag" and "spherical".
Each example is in one client's one release: one Gaussian mechanism of multiplier z. The server
trains on the synthetic features as without DP. Refused for components > 1 (EM's mixture is no
function of sums) and in central or distributed mode (the mixtures are no sums).

Defaults are the baseline's (README "Number of mixtures 1, Covariance type spherical, tolerance
1e-12, maximum EM iterations 1e3"; server head: AdamW lr 1e-4, batch 32, and 50 epochs as its
caltech-fedpft.toml, where its CIFAR-100 yaml has 1). A mixture of K components is fitted only to
more than K points (with one point it would send the feature itself, which FedPFT's data
minimisation avoids): the baseline skips a class with n_kc <= K (``small_classes="skip"``), so a
client holding few features of a class sends nothing of it, and a federation of such clients
trains its head on nothing. By default (``small_classes="fewer"``) such a class is fitted with the
most components its points allow under the same rule, K' = n_kc - 1 (the unused slots carry weight
0), and only a class with one feature on a client is not sent; with K = 1 both rules are the
baseline's. Classes no client sent are named in a note after training (the head never saw a
sample of them), and a run in which no client sent anything is refused: its head would be its
random initialisation. The baseline sends its mixtures in
float16; ``dtype="float16"`` does the same, float32 by default. The server's settings are named
server_* (as the baseline's) so that a client learning rate given to `compare` stays off them.

Partial participation works as FedNCM's: a client sends its mixtures once (``sent``); the server
keeps the mixtures received (one row per client, ``server_client_fields``: the round's uplink,
held) and, in every round that brings new ones, re-trains the head from its initialisation on
the synthetic features of all of them (a pure function of the mixtures and the seed), so the
head after every client has been seen is the one-round head. The mixtures are not sums: there
is no SecAgg+ form."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.algorithms.ccvr import class_statistics, fit_linear, gaussian_factor
from fedheads.algorithms.lp import init_mlp
from fedheads.algorithms.pfl_common import config_from_kwargs
from fedheads.core import rng
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import Params
from fedheads.core.protocol import AlgorithmBase, Init, LocalForm, RoundCtx, SecureForm

COVARIANCES = ("spherical", "diag", "full", "tied")
SMALL_CLASSES = ("fewer", "skip")
_DTYPES = {"float32": torch.float32, "float16": torch.float16}
_REG_COVAR = 1e-6  # scikit-learn GaussianMixture's default reg_covar, added to every covariance


@dataclass(frozen=True)
class FedPFTConfig:
    """FedPFT settings (the defaults of the authors' Flower baseline, adap/flower
    baselines/fedpft)."""

    components: int = setting(1, "mixture components K per class and client", source="baseline n-mixtures")
    covariance: str = setting("spherical", "mixture covariance type: spherical | diag | full | tied",
                              source="baseline cov-type")
    tol: float = setting(1e-12, "EM convergence tolerance", source="baseline tol")
    max_iter: int = setting(1000, "EM iterations at most", source="baseline README")
    dtype: str = setting("float32", "mixture parameters as sent: float32 | float16 (the baseline's)",
                         source="utils.learn_gmm")
    small_classes: str = setting("fewer", "a class with 2..K features on a client: fewer (fit n - 1 components) | "
                                 "skip (send nothing of it, the baseline's learn_gmm)", source="utils.learn_gmm")
    server_lr: float = setting(1e-4, "server AdamW learning rate of the head", source="baseline server-lr")
    server_weight_decay: float = setting(0.01, "server AdamW weight decay (torch's default)", source="baseline strategy.py")
    server_batch_size: int = setting(32, "server mini-batch of synthetic features", source="baseline server-batch-size")
    server_epochs: int = setting(50, "server epochs over the synthetic features", source="baseline num-epochs")

    def __post_init__(self) -> None:
        if self.covariance not in COVARIANCES:
            raise UserError(f"covariance {self.covariance!r}: must be one of {', '.join(COVARIANCES)}")
        if self.small_classes not in SMALL_CLASSES:
            raise UserError(f"small_classes {self.small_classes!r}: must be one of {', '.join(SMALL_CLASSES)}")
        if self.dtype not in _DTYPES:
            raise UserError(f"dtype {self.dtype!r}: must be one of {', '.join(_DTYPES)}")
        if min(self.components, self.max_iter, self.server_batch_size, self.server_epochs) < 1:
            raise UserError(f"components {self.components} / max_iter {self.max_iter} / server_batch_size "
                            f"{self.server_batch_size} / server_epochs {self.server_epochs}: must be >= 1")
        if not self.server_lr > 0 or self.server_weight_decay < 0 or not self.tol > 0:
            raise UserError(f"server_lr {self.server_lr} / tol {self.tol} must be > 0, server_weight_decay "
                            f"{self.server_weight_decay} >= 0")


@dataclass(frozen=True)
class FedPFTClientState:
    sent: torch.Tensor  # [M] bool: this client's mixtures have reached the server


@dataclass(frozen=True)
class FedPFTServerState:
    head: Params  # {"cls.weight": [D, C], "cls.bias": [C]} trained on the synthetic features
    head0: Params  # its initialisation (nn.Linear's, from the run seed): every re-training starts here
    weights: torch.Tensor  # [M, C, K] the mixtures received, one row per client (as FedPFTMessage)
    means: torch.Tensor  # [M, C, K, D]
    covariances: torch.Tensor  # [M, C, ...] by covariance type
    counts: torch.Tensor  # [M, C] int64 n_kc (0: no mixture)
    owner: torch.Tensor  # [M] int64 global id of the client whose mixtures the row holds (-1: none yet)


@dataclass(frozen=True)
class FedPFTBroadcast:
    """Nothing: the head is trained at the server, clients only send."""


@dataclass(frozen=True)
class FedPFTMessage:
    weights: torch.Tensor  # [M, C, K] mixture weights pi
    means: torch.Tensor  # [M, C, K, D]
    covariances: torch.Tensor  # [M, C, K] | [M, C, K, D] | [M, C, K, D, D] | [M, C, D, D] by type
    counts: torch.Tensor  # [M, C] int64 n_kc of the classes sent (0: not sent)
    client: torch.Tensor  # [M] int64 the sender's global id (keys its synthetic features)
    covariance: str = "spherical"  # the covariance type (COVARIANCES): what one component sends

    def comm_size(self) -> tuple[int, int]:
        """(values, bytes) one client sends, averaged over the clients and rounded: what a sender's
        mixtures hold (utils.learn_gmm), per class it sends its label, count and the components
        fitted (weight, mean, covariance; "tied": one covariance per class), and its id; the slots of
        classes not sent and of components not fitted (weight 0) are not sent."""
        M, C, K = self.weights.shape
        D = self.means.shape[-1]
        fitted = (self.weights > 0) & (self.counts > 0).unsqueeze(-1)  # [M, C, K] components sent
        comps, classes = int(fitted.sum()), int((self.counts > 0).sum())
        senders = int((self.counts > 0).any(1).sum())
        per_comp = 1 + D + {"spherical": 1, "diag": D, "full": D * D, "tied": 0}[self.covariance]
        per_class = D * D if self.covariance == "tied" else 0
        floats = comps * per_comp + classes * per_class
        ints = 2 * classes + senders  # label and count per class, the client id
        size = self.weights.element_size()
        m = max(M, 1)
        return round((floats + ints) / m), round((floats * size + 8 * ints) / m)



def cov_shape(kind: str, K: int, D: int) -> tuple[int, ...]:
    """Shape of one class's covariance parameters (scikit-learn's `covariances_`)."""
    return {"spherical": (K,), "diag": (K, D), "full": (K, D, D), "tied": (D, D)}[kind]


def gmm_seed(seed: int, client: int, c: int) -> int:
    """EM's k-means initialisation seed of (run seed, client global id, class)."""
    return int(rng.hash_keys(seed, client, c, 0xF7))


def fit_mixtures(x: np.ndarray, y: np.ndarray, num_classes: int, cfg: FedPFTConfig, seed: int, client: int,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One client's (weights [C,K], means [C,K,D], covariances [C,...], counts [C]): a
    GaussianMixture per class of k components fitted to more than k features (baseline learn_gmm):
    k = K, or for a class of 2..K features k = n - 1 under ``small_classes="fewer"`` (its other
    K - k slots hold weight 0, so no draw picks them); a class it cannot fit is not sent (count 0)."""
    from sklearn.mixture import GaussianMixture

    C, K, D = num_classes, cfg.components, x.shape[1]
    w, m = np.zeros((C, K)), np.zeros((C, K, D))
    s, n = np.zeros((C, *cov_shape(cfg.covariance, K, D))), np.zeros(C, dtype=np.int64)
    for c in range(C):
        xc = x[y == c]
        k = K if len(xc) > K else (len(xc) - 1 if cfg.small_classes == "fewer" else 0)
        if k < 1:
            continue
        g = GaussianMixture(n_components=k, covariance_type=cfg.covariance, tol=cfg.tol, max_iter=cfg.max_iter,
                            random_state=gmm_seed(seed, client, c)).fit(xc)
        w[c, :k], m[c, :k], n[c] = g.weights_, g.means_, len(xc)
        if cfg.covariance == "tied":
            s[c] = g.covariances_
        else:
            s[c, :k] = g.covariances_
    return w, m, s, n


def sample_mixture(weights: torch.Tensor, means: torch.Tensor, covariances: torch.Tensor, kind: str, n: int,
                   *key: int) -> torch.Tensor:
    """n draws [n, D] (float64) from one mixture: component j ~ Cat(weights), z = m_j + A_j eps."""
    K, D = means.shape
    w = weights.double().clamp(min=0)
    cdf = torch.cumsum(w / w.sum(), 0)
    rows = torch.arange(n)
    comp = torch.searchsorted(cdf, rng.uniform(*key, rows, -1)).clamp(max=K - 1)
    eps = rng.normal(*key, rows.view(-1, 1), torch.arange(D).view(1, -1))
    cov = covariances.double()
    if kind == "spherical":
        noise = eps * cov.clamp(min=0).sqrt()[comp].unsqueeze(-1)
    elif kind == "diag":
        noise = eps * cov.clamp(min=0).sqrt()[comp]
    elif kind == "full":
        noise = torch.einsum("nij,nj->ni", gaussian_factor(cov)[comp], eps)
    else:  # tied: one covariance for every component
        noise = eps @ gaussian_factor(cov).T
    return means.double()[comp] + noise


class FedPFT(AlgorithmBase):
    """FedPFT in the core's algorithm protocol (one round; the head is trained at the server)."""

    name = "fedpft"
    description = "FedPFT (Beitollahi et al. 2025): per-client class Gaussian mixtures, head trained on synthetic features"
    config = FedPFTConfig
    global_rule = "main"  # every client classifies with the server's head
    one_pass = True  # each client sends its mixtures once; later rounds only add zeros (one round with every client)
    server_client_fields = ("weights", "means", "covariances", "counts", "owner")

    def __init__(self, cfg: FedPFTConfig = FedPFTConfig()) -> None:
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]

    def init(self, spec: DataSpec, seed: int) -> Init:
        M, D, C, K, dev = spec.num_clients, spec.dim, spec.num_classes, self.cfg.components, spec.device
        head0 = {k: v.to(dev) for k, v in init_mlp(D, (), C, seed).items()}
        ss = FedPFTServerState(head0, head0, torch.zeros(M, C, K, dtype=self.dtype, device=dev),
                               torch.zeros(M, C, K, D, dtype=self.dtype, device=dev),
                               torch.zeros(M, C, *cov_shape(self.cfg.covariance, K, D), dtype=self.dtype, device=dev),
                               torch.zeros(M, C, dtype=torch.int64, device=dev),
                               torch.full((M,), -1, dtype=torch.int64, device=dev))
        return Init(FedPFTClientState(torch.zeros(M, dtype=torch.bool, device=dev)), ss, FedPFTBroadcast())

    def client_update(self, cs: FedPFTClientState, bc: FedPFTBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedPFTClientState, FedPFTMessage]:
        cfg, C, D, dev = self.cfg, data.num_classes, data.dim, data.device
        M, K = data.num_clients, cfg.components
        w = torch.zeros(M, C, K, dtype=self.dtype, device=dev)
        m = torch.zeros(M, C, K, D, dtype=self.dtype, device=dev)
        s = torch.zeros(M, C, *cov_shape(cfg.covariance, K, D), dtype=self.dtype, device=dev)
        n = torch.zeros(M, C, dtype=torch.int64, device=dev)
        sent = cs.sent.tolist()
        for i in range(M):
            if sent[i]:  # a client contributes exactly once
                continue
            rows = data.m_train[i]
            x = data.x_train[i][rows].double().cpu().numpy()
            y = data.y_train[i][rows].cpu().numpy()
            wi, mi, si, ni = fit_mixtures(x, y, C, cfg, ctx.seed, int(data.client_index[i]))
            for dst, src in ((w, wi), (m, mi), (s, si), (n, ni)):
                dst[i] = torch.from_numpy(src).to(device=dev, dtype=dst.dtype)
        return FedPFTClientState(torch.ones_like(cs.sent)), FedPFTMessage(w, m, s, n, data.client_index.clone(),
                                                                          cfg.covariance)

    def server_aggregate(self, ss: FedPFTServerState, msg: FedPFTMessage,
                         ctx: RoundCtx) -> tuple[FedPFTServerState, FedPFTBroadcast]:
        new = (msg.counts > 0).any(1)
        if not bool(new.any()):
            return ss, FedPFTBroadcast()
        pos = ctx.participants.to(ss.owner.device)[new.to(ss.owner.device)]
        rows = new.nonzero().view(-1)
        put = lambda held, got: held.index_copy(0, pos, got.index_select(0, rows).to(held.device, held.dtype))  # noqa: E731
        ss = replace(ss, weights=put(ss.weights, msg.weights), means=put(ss.means, msg.means),
                     covariances=put(ss.covariances, msg.covariances), counts=put(ss.counts, msg.counts),
                     owner=put(ss.owner, msg.client))
        x, y = self.synthetic(ss, ctx.seed)
        head = fit_linear(ss.head0, x.to(ss.head0["cls.weight"].device), y.to(ss.head0["cls.weight"].device),
                          optimizer="adamw", lr=self.cfg.server_lr, weight_decay=self.cfg.server_weight_decay,
                          epochs=self.cfg.server_epochs, batch_size=self.cfg.server_batch_size, key=(ctx.seed, 0xF7))
        return replace(ss, head=head), FedPFTBroadcast()

    def synthetic(self, ss: FedPFTServerState, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every synthetic feature the held mixtures give (baseline aggregate_fit): n_kc draws from
        client k's mixture of class c, keyed by (seed, k's global id, c, row) and listed by
        client id, whatever the clients' positions in the federation."""
        owner = ss.owner.cpu()
        xs, ys = [], []
        for p in sorted((p for p in range(owner.numel()) if owner[p] >= 0), key=lambda p: int(owner[p])):
            for c, n in enumerate(ss.counts[p].tolist()):
                if n > 0:
                    xs.append(sample_mixture(ss.weights[p, c].cpu(), ss.means[p, c].cpu(),
                                             ss.covariances[p, c].cpu(), self.cfg.covariance, n, seed, int(owner[p]), c))
                    ys.append(torch.full((n,), c, dtype=torch.int64))
        return torch.cat(xs).float(), torch.cat(ys)

    def predict(self, cs: FedPFTClientState, ss: FedPFTServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        s = x @ ss.head["cls.weight"].to(x.dtype) + ss.head["cls.bias"].to(x.dtype)
        return {"main": s}

    def trained_notes(self, ss: FedPFTServerState, classes: list[str]) -> list[str]:
        """Refuses a head no mixture reached (its random initialisation); names the classes no
        client sent, which the head never saw a synthetic sample of."""
        sent = (ss.counts > 0).any(0).cpu()
        k = 1 if self.cfg.small_classes == "fewer" else self.cfg.components
        rule = f"at most {k} training feature{'s' if k > 1 else ''}"
        if not bool(sent.any()):
            raise UserError(f"fedpft: no client sent a Gaussian mixture, so the head is its random initialisation: "
                            f"every client holds {rule} of each class it has (FedPFT fits no "
                            "mixture to so few, which would send the features themselves; under --dp-mode local the "
                            "noisy counts may hide them); use fedncm, fed3r or fedcof, which need no minimum")
        missing = [classes[c] if c < len(classes) else str(c) for c in (~sent).nonzero().view(-1).tolist()]
        if not missing:
            return []
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return [f"fedpft: no client sent a mixture of class(es) {shown} (each client holds {rule} "
                "of them), so the head never saw a sample of them"]

    def secure_form(self, message: object = None) -> SecureForm:
        raise UserError("secagg: fedpft sends each client's Gaussian mixtures (weights, means, covariances), "
                        "which are not sums of client contributions, so SecAgg+ cannot aggregate them")

    def trainable_params(self, cs: FedPFTClientState) -> int:
        return 0  # clients fit mixtures in closed form (EM); the head is trained at the server

    def dp_sensitivity(self, clip: float) -> dict[str, float]:
        """One example with ||x|| <= clip moves one class's count by 1, sum by clip and second
        moment by ||x x^T||_F = clip^2 (module docstring); one component only."""
        if self.cfg.components != 1:
            raise UserError(f"dp: fedpft with components={self.cfg.components}: its local DP form releases one "
                            "Gaussian per class from noisy sums (an EM mixture is no function of sums); use components=1")
        c = float(clip)
        return {"sums": c, "sq": c * c, "counts": 1.0}

    def local_form(self) -> LocalForm:
        """Each fresh client's per-class (count, sum, second moment), and its one-Gaussian-per-class
        message fitted to their noisy versions (module docstring)."""
        def stats(cs: FedPFTClientState, bc: FedPFTBroadcast, data: FedData, ctx: RoundCtx,
                  ) -> tuple[FedPFTClientState, dict[str, torch.Tensor], torch.Tensor]:
            fresh = ~cs.sent.to(data.device)  # a client contributes exactly once: the others' rows count for nothing
            rows = data.m_train & fresh.to(data.m_train.device).view(-1, 1)
            # full/tied: sum x x^T [M, C, D, D]; spherical/diag read the diagonal only: sum x * x [M, C, D],
            # ||x * x|| <= ||x||^2 = clip^2
            diagonal = self.cfg.covariance not in ("full", "tied")
            sums, sq, counts = class_statistics(data.x_train, data.y_train, rows, data.num_classes, diagonal)
            out = {"sums": sums, "sq": sq, "counts": counts.double()}
            return FedPFTClientState(torch.ones_like(cs.sent)), out, fresh

        def message(noisy: dict[str, torch.Tensor], release: torch.Tensor, data: FedData,
                    ctx: RoundCtx) -> FedPFTMessage:
            return self.gaussians_message(noisy["sums"], noisy["sq"], noisy["counts"], release, data.client_index)

        return LocalForm(stats, message)

    def gaussians_message(self, sums: torch.Tensor, sq: torch.Tensor, counts: torch.Tensor, release: torch.Tensor,
                          client: torch.Tensor) -> FedPFTMessage:
        """One Gaussian per class [M, C] from (noisy) statistics: scikit-learn's one-component fit
        (mean, maximum-likelihood covariance + reg_covar I) in the configured covariance type.
        `sq`: per-class sums of x x^T [M, C, D, D] ("full", "tied") or of x * x [M, C, D]
        ("spherical", "diag": the diagonal is all they read)."""
        M, C, D = sums.shape
        n = counts.round().clamp(min=0)
        send = (n > self.cfg.components) & release.to(n.device).view(-1, 1)
        nn = n.clamp(min=1).unsqueeze(-1)
        mu = sums / nn
        kind = self.cfg.covariance
        if sq.dim() == 3:  # the diagonal only
            var = (sq / nn - mu * mu + _REG_COVAR).clamp(min=_REG_COVAR)
            par = var.unsqueeze(2) if kind == "diag" else var.mean(-1, keepdim=True)
        else:  # "full", "tied": the nearest positive semidefinite matrix (negative eigenvalues to 0)
            cov = sq / nn.unsqueeze(-1) - mu.unsqueeze(-1) * mu.unsqueeze(-2)
            cov = 0.5 * (cov + cov.transpose(-1, -2)) + _REG_COVAR * torch.eye(D, dtype=cov.dtype, device=cov.device)
            lam, vec = torch.linalg.eigh(cov)
            cov = (vec * lam.clamp(min=0).unsqueeze(-2)) @ vec.transpose(-1, -2)
            par = cov.unsqueeze(2) if kind == "full" else cov
        keep = send.to(torch.float64)
        par = par * keep.view(M, C, *([1] * (par.dim() - 2)))
        return FedPFTMessage((keep.unsqueeze(-1)).to(self.dtype), (mu * keep.unsqueeze(-1)).unsqueeze(2).to(self.dtype),
                             par.to(self.dtype), (n * keep).to(torch.int64), client.clone(), kind)


def _factory(**kw: object) -> FedPFT:
    return FedPFT(config_from_kwargs(FedPFTConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fedpft", _factory, description=FedPFT.description, config=FedPFT.config)
