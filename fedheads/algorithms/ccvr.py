"""CCVR (Luo et al., "No Fear of Heterogeneity: Classifier Calibration for Federated Learning with
Non-IID Data", NeurIPS 2021, Sec. 4, Alg. 1) on cached features: a linear head trained with
FedAvg (lp.py's HeadTuning, held by composition), whose classifier the server re-trains
(calibrates) on virtual features sampled from the federated per-class feature Gaussians.

Statistics (Sec. 4, "Feature distribution estimation"). Client k sends, per class c, the sums
s_kc = sum x, q_kc = sum x x^T and the count n_kc. The server forms N_c = sum_k n_kc,
mu_c = sum_k s_kc / N_c and the unbiased covariance
    Sigma_c = (sum_k q_kc - N_c mu_c mu_c^T) / (N_c - 1),
which equals the paper's global covariance from local ones (Sec. 4),
    Sigma_c = sum_k (n_kc - 1)/(N_c - 1) Sigma_kc + sum_k n_kc/(N_c - 1) mu_kc mu_kc^T
              - N_c/(N_c - 1) mu_c mu_c^T,
for unbiased local covariances Sigma_kc. Sent as sums, the statistics run under SecAgg+ as they
are (`secure_form`), in float64. ``covariance="fl-bench"`` reproduces KarhouTam/FL-bench
(src/server/ccvr.py, the reference code: the paper has none), whose clients put the population
covariance (``correction=0``) into that formula; each client then sends
(n_kc - 1)/n_kc q_kc + mu_kc mu_kc^T in place of q_kc, still a sum. Classes with N_c < 2 have
no covariance and get no virtual features (as FL-bench).

Calibration (Sec. 4, "Virtual representations generation" and "Classifier re-training"): M_c =
``virtual_per_class`` features z ~ N(mu_c, Sigma_c) per class (z = mu_c + A_c eps with A_c A_c^T
= Sigma_c from an eigendecomposition, since Sigma_c is singular when N_c <= D; eps a counter-based
normal of (seed, round, c, j, d): core/rng.py), then the classifier is re-trained on them by SGD
with the cross-entropy, starting from the FedAvg head: ``calib_epochs`` passes of mini-batches of
``calib_batch_size`` (FL-bench: one pass, the clients' batch size and learning rate). FL-bench
calibrates a copy of the global model before every evaluation and trains on from the
uncalibrated one; so does this file: after every round the server keeps the FedAvg head (it goes
on training) and the calibrated head (``predict``'s "main"; "fedavg" is the uncalibrated head).

Rounds. The head is linear on the frozen cached features, so the features whose statistics CCVR
needs (the classifier's input) do not change during training: each client sends its statistics
once, with its first FedAvg update, rather than after training (Alg. 1); every round trains. The
broadcast asks for statistics while some client has not reported (``reported``, one server row
per client); with full participation that is round 0 only. A client that has reported sends zeros
in a round that still collects (as FedNCM under partial participation), and calibration uses the
clients reported so far. The paper calibrates the model of a finished FedAvg run once; here the
head after R rounds is the FedAvg-LP head of R rounds, calibrated.

``head=RUN_DIR`` calibrates the head of any saved ``fedheads train`` run instead (one seed, the
first unless ``head_seed``): its global rule must be a linear head, scores = x W + b, which is
read off the run's own ``predict`` at x = 0 and the unit vectors and checked on random features
(FedNCM's cosine rule, for one, is refused), and that run must have been trained on this run's
classes (names, in order) and backbones (dimension, weights, preprocessing): `saved_runs` names
it, and the drivers refuse another store's head before training (fedheads.run.identity). The
clients then train nothing: they send their statistics, and the server, in its first round,
reads that head and calibrates it (so the states this run saves hold it, and predicting from
them does not read the other run).

Differential privacy (fedheads.privacy's Gaussian mechanism on the secure sums) applies when a
saved head is calibrated with ``covariance="paper"``: the clients then send nothing but s_kc, q_kc
and n_kc, sums over examples whose sensitivities to one example with ||x|| <= C are C,
C^2 (||x x^T||_F = ||x||^2) and 1 (`dp_sensitivity`). It is refused where the FedAvg-LP head is
trained here (its SGD deltas are no clipped sums) and for ``covariance="fl-bench"`` (no sum over
examples). The server's steps from the noisy totals are post-processing. Presence is itself a
statistic of the data, so only the noisy counts decide it, on their running total: N_c is the sum
of every collecting round's noisy count (each rounded to an integer) and a class is usable where
N_c >= 2. The private wrapper clamps the totals of a secure form's integer fields to >= 1 in every
round (FedNCM's positive divisor); per round, that would add at least 1 for each further collecting
round (partial participation), calibrating a class no client holds on virtual features of pure
noise after two. CCVR therefore declares `clamp_noisy_counts = False` and takes the raw noisy
totals, in every mode: a class no client holds has a running total of zero-mean noise, of
variance R sigma_n^2 after R collecting rounds, usable only where its rounded draws add up to 2 or
more. The noisy Sigma_c is symmetrised (`class_gaussians`) and may be indefinite, and
`gaussian_factor` clips its negative eigenvalues to 0, which samples from the nearest positive
semidefinite matrix in Frobenius norm (Higham, "Computing a Nearest Symmetric Positive Semidefinite
Matrix", Linear Algebra Appl. 1988). results.json's privacy block accounts for the statistics of
this run; the saved head is another release of its own run's data (its own results.json), which
composes with this one where the data are the same: `dp_finalize` records that run's privacy block
(or that it has none) beside this run's, and warns when the saved head was trained without
differential privacy (then the calibrated head is not private)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms.fedncm import client_stats
from fedheads.algorithms.lp import HeadBroadcast, HeadClientState, HeadServerState, HeadTuning, LPConfig, logits
from fedheads.algorithms.pfl_common import DeltaMessage, Empty, config_from_kwargs, expand
from fedheads.core import rng
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.heads import Params, count_params
from fedheads.core.optim import OptimizerConfig
from fedheads.core.protocol import AlgorithmBase, Init, RoundCtx, SecureForm

COVARIANCES = ("paper", "fl-bench")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CCVRConfig:
    """CCVR settings: the calibration's (CCVR Sec. 4; FL-bench src/server/ccvr.py defaults, the
    paper leaving M_c and the re-training schedule to the reader) and the FedAvg-LP head's
    (lp.py's defaults, FedNCM paper App. B)."""

    virtual_per_class: int = setting(200, "virtual features M_c drawn per class from N(mu_c, Sigma_c)",
                                     source="Sec. 4; FL-bench --sample_per_class")
    calib_lr: float | None = setting(None, "calibration SGD learning rate; None: the clients' lr",
                                     source="FL-bench calibrate_classifier")
    calib_batch_size: int | None = setting(None, "calibration mini-batch size; None: the clients' batch_size",
                                           source="FL-bench calibrate_classifier")
    calib_epochs: int = setting(1, "passes over the virtual features", source="FL-bench calibrate_classifier")
    covariance: str = setting("paper", "'paper' (the pooled unbiased covariance) | 'fl-bench' (its "
                              "correction=0 local covariances)", source="Sec. 4")
    optimizer: OptimizerConfig = setting(default_factory=lambda: OptimizerConfig("sgd", lr=0.1, weight_decay=0.0),
                                         doc="client optimiser of the FedAvg rounds", source="FedNCM App. B (lp)")
    batch_size: int = setting(32, "local mini-batch size of the FedAvg rounds", source="FedPCL Sec. 5.1 (lp)")
    local_epochs: int = setting(1, "local epochs E of the FedAvg rounds", source="FedNCM Sec. 4 (lp)")
    server_opt: str = setting("fedavg", "server optimiser of the head: fedavg | fedprox | fedadam | fedavgm",
                              source="lp.py")
    server_lr: float | None = setting(None, "server step size; None: the optimiser's default", source="lp.py")
    head: str | None = setting(None, "a fedheads run directory whose linear head is calibrated (no FedAvg "
                               "rounds); None: the FedAvg-LP head trained here", source="")
    head_seed: int | None = setting(None, "the seed of that run whose head is calibrated; None: its first")

    def __post_init__(self) -> None:
        if self.virtual_per_class < 1 or self.calib_epochs < 1:
            raise UserError(f"virtual_per_class {self.virtual_per_class} / calib_epochs {self.calib_epochs}: must be >= 1")
        if self.calib_batch_size is not None and self.calib_batch_size < 1:
            raise UserError(f"calib_batch_size {self.calib_batch_size}: must be >= 1")
        if self.calib_lr is not None and not self.calib_lr > 0:
            raise UserError(f"calib_lr {self.calib_lr}: must be > 0")
        if self.covariance not in COVARIANCES:
            raise UserError(f"covariance {self.covariance!r}: must be one of {', '.join(COVARIANCES)}")

    def lp_config(self) -> LPConfig:
        return LPConfig(optimizer=self.optimizer, batch_size=self.batch_size, local_epochs=self.local_epochs,
                        server_opt=self.server_opt, server_lr=self.server_lr)


@dataclass(frozen=True)
class CCVRClientState:
    lp: HeadClientState  # the FedAvg-LP client state
    sent: torch.Tensor  # [M] bool: this client's statistics have reached the server


@dataclass(frozen=True)
class CCVRServerState:
    lp: HeadServerState  # the FedAvg head w (uncalibrated; FedAvg goes on from it)
    sums: torch.Tensor  # [C, D] float64 sum_k s_kc
    sq: torch.Tensor  # [C, D, D] float64 sum_k q_kc
    counts: torch.Tensor  # [C] int64 N_c
    reported: torch.Tensor  # [M] bool, one row per client: its statistics have arrived
    mu: torch.Tensor  # [C, D] float64 mu_c of the statistics so far
    factor: torch.Tensor  # [C, D, D] float64 A_c, A_c A_c^T = Sigma_c (computed when statistics arrive)
    usable: torch.Tensor  # [C] bool N_c >= 2
    calibrated: Params  # {"cls.weight": [D, C], "cls.bias": [C]} the calibrated head


@dataclass(frozen=True)
class CCVRBroadcast:
    lp: HeadBroadcast  # the FedAvg head
    collect: bool  # some client has not sent its statistics yet
    trains: bool  # the clients train the head (False: a saved head is calibrated, clients only need `collect`)

    def comm_size(self) -> tuple[int, int]:
        return self.lp.comm_size() if self.trains else (1, 1)


@dataclass(frozen=True)
class CCVRMessage:
    """A FedAvg update plus, while the server collects them, the class statistics."""

    lp: DeltaMessage | None  # w_k - w and its weight n_k (None: calibrating a saved head, nothing trains)
    sums: torch.Tensor  # [M, C, D] float64 s_kc (zeros once sent)
    sq: torch.Tensor  # [M, C, D, D] float64 q_kc (or FL-bench's form, module docstring)
    counts: torch.Tensor  # [M, C] int64 n_kc
    fresh: torch.Tensor  # [M] bool: the statistics are this client's first


@dataclass(frozen=True)
class CCVRSums:
    """Many clients' messages added (the vectorised engine's summed path, `summed_update`): the
    n-weighted sums of their FedAvg deltas with the weights' sum, and the sums of their class
    statistics (C' = 0 classes in a round that does not collect)."""

    wdelta: dict[str, torch.Tensor]  # {name: [1, ...]} sum_k n_k (w_k - w) (empty: a saved head, nothing trains)
    weight: torch.Tensor  # [1] sum_k n_k (0 without deltas)
    sums: torch.Tensor  # [1, C', D] float64
    sq: torch.Tensor  # [1, C', D, D] float64
    counts: torch.Tensor  # [1, C'] int64

    def comm_size(self) -> tuple[int, int]:
        """(values, bytes) ONE client sends, as in the per-client messages: its float32 delta and
        weight, and while collecting its statistics and its fresh flag (every client sends the same
        shapes, so no count of clients is needed)."""
        delta = sum(v[0].numel() for v in self.wdelta.values()) + (1 if self.wdelta else 0)
        stats = self.sums[0].numel() + self.sq[0].numel() + self.counts[0].numel()
        fresh = 1 if self.counts.shape[1] else 0
        return delta + stats + fresh, 4 * delta + 8 * stats + fresh


@dataclass(frozen=True)
class CCVRFresh:
    """What travels in the clear under SecAgg+ in a collecting round."""

    fresh: torch.Tensor  # [M] bool: the client's statistics are in this round's sums


def second_moments(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int,
                   block_elems: int = 1 << 22) -> torch.Tensor:
    """q_kc = sum over client k's rows of class c of x x^T, float64 [M, C, D, D]: outer products
    of blocks of rows added into their (client, class) slot (padding rows into a dump slot)."""
    M, N, D = x.shape
    C = num_classes
    slot = torch.where(mask, torch.arange(M, device=x.device).view(M, 1) * C + y,
                       torch.full_like(y, M * C)).reshape(-1)
    flat = x.reshape(M * N, D)
    q = torch.zeros(M * C + 1, D * D, dtype=torch.float64, device=x.device)
    rows = max(1, block_elems // (D * D))
    for a in range(0, M * N, rows):
        xb = flat[a:a + rows].double()
        q.index_add_(0, slot[a:a + rows], (xb.unsqueeze(2) * xb.unsqueeze(1)).reshape(-1, D * D))
    return q[:-1].view(M, C, D, D)


def class_statistics(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int, diagonal: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class statistics of stacked clients' rows (mask True), as sums (Sec. 4): s_kc [M, C, D]
    float64 and n_kc [M, C] int64 (fedncm.client_stats) and q_kc = sum x x^T [M, C, D, D] float64
    (`second_moments`), or with `diagonal` only its diagonal, sum x * x [M, C, D] (FedPFT's
    spherical and diagonal Gaussians). A client none of whose rows is in `mask` gets zeros."""
    sums, counts = client_stats(x, y, mask, num_classes)
    if diagonal:
        sq = client_stats(x.double() * x.double(), y, mask, num_classes)[0]
    else:
        sq = second_moments(x, y, mask, num_classes)
    return sums, sq, counts


def class_gaussians(sums: torch.Tensor, sq: torch.Tensor, counts: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mu [C, D], Sigma [C, D, D], usable [C]) from summed statistics (CCVR Sec. 4's global covariance as sums);
    classes with N_c < 2 are not usable (zeros)."""
    n = counts.to(sums.dtype)
    usable = counts >= 2
    mu = sums / n.clamp(min=1).unsqueeze(-1)
    outer = n.view(-1, 1, 1) * mu.unsqueeze(2) * mu.unsqueeze(1)
    cov = (sq - outer) / (n - 1).clamp(min=1).view(-1, 1, 1)
    cov = 0.5 * (cov + cov.transpose(1, 2))  # exact symmetry for eigh
    keep = usable.view(-1, 1, 1)
    return mu * usable.unsqueeze(-1), torch.where(keep, cov, torch.zeros_like(cov)), usable


def gaussian_factor(cov: torch.Tensor) -> torch.Tensor:
    """A with A A^T = cov for symmetric PSD cov [..., D, D] (eigenvalues clipped at 0: the sample
    covariance of N_c <= D features is singular, so no Cholesky)."""
    lam, vec = torch.linalg.eigh(cov)
    return vec * lam.clamp(min=0).sqrt().unsqueeze(-2)


def virtual_features(mu: torch.Tensor, factor: torch.Tensor, usable: torch.Tensor, per_class: int, seed: int,
                     round_: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(z [V, D] float32, labels [V]) with `per_class` draws z = mu_c + A_c eps for every usable
    class c (CCVR Sec. 4; A_c = `factor`[c], gaussian_factor of Sigma_c); eps is keyed by
    (seed, round, c, j, d)."""
    C, D = mu.shape
    cls = usable.nonzero().view(-1)
    if cls.numel() == 0:
        return mu.new_zeros(0, D, dtype=torch.float32), torch.zeros(0, dtype=torch.int64, device=mu.device)
    j = torch.arange(per_class, device=mu.device)
    d = torch.arange(D, device=mu.device)
    eps = rng.normal(seed, round_, cls.view(-1, 1, 1), j.view(1, -1, 1), d.view(1, 1, -1)).to(mu.device)
    z = mu[cls].unsqueeze(1) + eps @ factor[cls].transpose(1, 2)
    return z.reshape(-1, D).float(), cls.repeat_interleave(per_class)


def shuffled(n: int, *key: int, device: torch.device | None = None) -> torch.Tensor:
    """A permutation of n rows keyed by `key` (same on every engine and device)."""
    return torch.argsort(rng.uniform(*key, torch.arange(n, device=device)), stable=True)


def fit_linear(head: Params, x: torch.Tensor, y: torch.Tensor, *, optimizer: str, lr: float, epochs: int,
               batch_size: int, key: tuple[int, ...], weight_decay: float = 0.0,
               order: Callable[[int, int], torch.Tensor] | None = None) -> Params:
    """Central training of the linear head {"cls.weight": [D, C], "cls.bias": [C]} on (x, y) with
    the mean cross-entropy: torch.optim.SGD (no momentum) or torch.optim.AdamW, one step per
    mini-batch of `batch_size` rows in a keyed shuffle per epoch (the last batch may be smaller,
    as a DataLoader's). `order(epoch, n)` replaces the shuffle (tests)."""
    w = head["cls.weight"].detach().clone().requires_grad_(True)
    b = head["cls.bias"].detach().clone().requires_grad_(True)
    if x.shape[0] == 0:
        return {"cls.weight": w.detach(), "cls.bias": b.detach()}
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD([w, b], lr=lr, weight_decay=weight_decay)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW([w, b], lr=lr, weight_decay=weight_decay)
    else:
        raise UserError(f"optimizer {optimizer!r}: must be 'sgd' or 'adamw'")
    n = x.shape[0]
    with torch.enable_grad():
        for e in range(epochs):
            perm = order(e, n) if order is not None else shuffled(n, *key, e, device=x.device)
            for a in range(0, n, batch_size):
                idx = perm[a:a + batch_size]
                loss = torch.nn.functional.cross_entropy(x[idx] @ w + b, y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return {"cls.weight": w.detach(), "cls.bias": b.detach()}


class CCVR(AlgorithmBase):
    """FedAvg-LP whose classifier is calibrated on virtual features after every round."""

    name = "ccvr"
    description = "CCVR (Luo et al. 2021): FedAvg linear head calibrated on features sampled from class Gaussians"
    config = CCVRConfig
    global_rule = "main"  # the calibrated head is the server's
    server_client_fields = ("reported",)
    sums_messages = True  # the server reads only sums: of the n-weighted deltas and of the class statistics
    clamp_noisy_counts = False  # presence is decided on the running total of the noisy counts

    def __init__(self, cfg: CCVRConfig = CCVRConfig()) -> None:
        self.cfg = cfg
        self.lp = HeadTuning(cfg.lp_config(), name="lp")
        self.calib_lr = cfg.calib_lr if cfg.calib_lr is not None else cfg.optimizer.lr
        self.calib_bs = cfg.calib_batch_size if cfg.calib_batch_size is not None else cfg.batch_size
        self._saved: tuple[torch.Tensor, torch.Tensor] | None = None  # head=RUN_DIR's (W, b), once read
        self._run: Any = None  # that run, opened by the driver (use_saved)

    def init(self, spec: DataSpec, seed: int) -> Init:
        lp = self.lp.init(spec, seed)
        C, D, dev = spec.num_classes, spec.dim, spec.device
        ss = CCVRServerState(lp.server_state, torch.zeros(C, D, dtype=torch.float64, device=dev),
                             torch.zeros(C, D, D, dtype=torch.float64, device=dev),
                             torch.zeros(C, dtype=torch.int64, device=dev),
                             torch.zeros(spec.num_clients, dtype=torch.bool, device=dev),
                             torch.zeros(C, D, dtype=torch.float64, device=dev),
                             torch.zeros(C, D, D, dtype=torch.float64, device=dev),
                             torch.zeros(C, dtype=torch.bool, device=dev), _head(lp.server_state.params))
        cs = CCVRClientState(lp.client_state, torch.zeros(spec.num_clients, dtype=torch.bool, device=dev))
        return Init(cs, ss, CCVRBroadcast(lp.broadcast, True, self.cfg.head is None))

    def client_update(self, cs: CCVRClientState, bc: CCVRBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[CCVRClientState, CCVRMessage | DeltaMessage | Empty]:
        delta: DeltaMessage | None = None
        lp_cs = cs.lp
        if self.cfg.head is None:  # FedAvg-LP's local training
            lp_cs, d = self.lp.client_update(cs.lp, bc.lp, data, ctx)
            assert isinstance(d, DeltaMessage)
            delta = d
        if not bc.collect:
            return CCVRClientState(lp_cs, cs.sent), Empty() if delta is None else delta
        fresh = ~cs.sent.to(data.device)  # a client reports once: the others' rows count for nothing
        rows = data.m_train & fresh.to(data.m_train.device).view(-1, 1)
        sums, sq, counts = class_statistics(data.x_train, data.y_train, rows, data.num_classes)
        if self.cfg.covariance == "fl-bench":  # (n-1)/n q + mu mu^T: FL-bench's correction=0 local covariances
            n = counts.to(sq.dtype)
            mu = sums / n.clamp(min=1).unsqueeze(-1)
            sq = ((n - 1).clamp(min=0) / n.clamp(min=1)).unsqueeze(-1).unsqueeze(-1) * sq \
                + mu.unsqueeze(-1) * mu.unsqueeze(-2)
        msg = CCVRMessage(delta, sums, sq, counts, fresh)
        return CCVRClientState(lp_cs, torch.ones_like(cs.sent)), msg

    def summed_update(self, cs: CCVRClientState, bc: CCVRBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[CCVRClientState, CCVRSums | Empty]:
        """The clients' FedAvg deltas, n-weighted and added, and their class statistics summed from
        their rows pooled: no per-client [C, D, D] second moments are made (CCVR under label skew
        at 100 clients would stack 13 GB of them)."""
        wdelta: dict[str, torch.Tensor] = {}
        weight = torch.zeros(1, dtype=torch.float64, device=data.device)
        lp_cs = cs.lp
        if self.cfg.head is None:
            lp_cs, d = self.lp.client_update(cs.lp, bc.lp, data, ctx)
            assert isinstance(d, DeltaMessage)
            w = d.weight.to(torch.float64)
            wdelta = {k: torch.tensordot(w.to(v.device), v.double(), dims=1).unsqueeze(0) for k, v in d.delta.items()}
            weight = w.sum().view(1)
        C, D = data.num_classes, data.dim
        if not bc.collect:
            if not wdelta:
                return CCVRClientState(lp_cs, cs.sent), Empty()
            z = torch.zeros(1, 0, D, dtype=torch.float64, device=data.device)
            return CCVRClientState(lp_cs, cs.sent), CCVRSums(wdelta, weight, z, z.unsqueeze(-1).expand(1, 0, D, D),
                                                             torch.zeros(1, 0, dtype=torch.int64, device=data.device))
        if self.cfg.covariance == "fl-bench":
            raise UserError("ccvr covariance='fl-bench' sends per-client rescaled moments, which do not add from pooled "
                            "rows; run it with fewer clients (the engine then holds the per-client messages)")
        M, N = data.y_train.shape
        rows = data.m_train & ~cs.sent.to(data.m_train.device).view(-1, 1)
        sums, sq, counts = class_statistics(data.x_train.reshape(1, M * N, D), data.y_train.reshape(1, M * N),
                                            rows.reshape(1, M * N), C)
        return CCVRClientState(lp_cs, torch.ones_like(cs.sent)), CCVRSums(wdelta, weight, sums, sq, counts)

    def server_aggregate(self, ss: CCVRServerState, msg: CCVRMessage | CCVRSums | DeltaMessage | Empty,
                         ctx: RoundCtx) -> tuple[CCVRServerState, CCVRBroadcast]:
        if isinstance(msg, Empty):  # a saved head, every statistic in: nothing changes
            return self._idle(ss)
        if isinstance(msg, CCVRSums):  # the summed path: every participant has now reported
            if msg.counts.shape[1]:
                ss = self._collect(ss, msg.sums[0], msg.sq[0], msg.counts[0], None, ctx)
            d = None
            if msg.wdelta:
                w = msg.weight
                d = DeltaMessage({k: (v / w.to(v.device)).float() for k, v in msg.wdelta.items()}, {}, w.float())
            return self._step(ss, d, ctx)
        if isinstance(msg, CCVRMessage):  # sums of client contributions ...
            ss = self._collect(ss, msg.sums.sum(0), msg.sq.sum(0), msg.counts.sum(0), msg.fresh, ctx)
            return self._step(ss, msg.lp, ctx)
        return self._step(ss, msg, ctx)  # ... then FedAvg and the calibration (the finalize)

    def _idle(self, ss: CCVRServerState) -> tuple[CCVRServerState, CCVRBroadcast]:
        return ss, CCVRBroadcast(HeadBroadcast(ss.lp.params, False), False, False)

    def _collect(self, ss: CCVRServerState, sums: torch.Tensor, sq: torch.Tensor, counts: torch.Tensor,
                 fresh: torch.Tensor | None, ctx: RoundCtx) -> CCVRServerState:
        reported = ss.reported.clone()  # fresh None: every participant (a participant not yet reported always sends)
        part = ctx.participants.to(reported.device)
        reported[part] |= True if fresh is None else fresh.to(reported.device)
        sums, sq, counts = ss.sums + sums.to(ss.sums.dtype), ss.sq + sq.to(ss.sq.dtype), ss.counts + counts.to(ss.counts.dtype)
        mu, cov, usable = class_gaussians(sums, sq, counts)  # the finalize, once per new statistics
        return replace(ss, sums=sums, sq=sq, counts=counts, reported=reported, mu=mu, factor=gaussian_factor(cov),
                       usable=usable)

    def _step(self, ss: CCVRServerState, msg: DeltaMessage | None,
              ctx: RoundCtx) -> tuple[CCVRServerState, CCVRBroadcast]:
        if msg is None:  # a saved head (read by the server, once): calibrated, never trained
            lp_ss = replace(ss.lp, params=self.saved_head(ss.lp.params))
            lp_bc = HeadBroadcast(lp_ss.params, False)
        else:
            lp_ss, lp_bc = self.lp.server_aggregate(ss.lp, msg, ctx)
        calibrated = self.calibrate(_head(lp_ss.params), ss, ctx.seed, ctx.round)
        bc = CCVRBroadcast(lp_bc, not bool(ss.reported.all()), msg is not None)
        return replace(ss, lp=lp_ss, calibrated=calibrated), bc

    def saved_runs(self) -> dict[str, tuple[str, int | None]]:
        return {} if self.cfg.head is None else {"head": (self.cfg.head, self.cfg.head_seed)}

    def use_saved(self, key: str, run: Any) -> None:
        self._run = run  # read off in the first round (saved_head), once its D and C are known

    def saved_head(self, like: Params) -> Params:
        """The head of the run `head` names (read on the first call; the run's own states, saved
        and predicted from, never read it again)."""
        assert self.cfg.head is not None
        if self._saved is None:
            if self._run is None:
                raise UserError(f"ccvr: head={self.cfg.head}: the run was not opened; train through fedheads.train or "
                                "`fedheads train`, which open the runs an algorithm reads")
            D, C = like["cls.weight"].shape
            self._saved = saved_linear_head(self._run, f"head={self.cfg.head}", D, C)
        w, b = self._saved
        return {**like, "cls.weight": w.to(like["cls.weight"].device), "cls.bias": b.to(like["cls.bias"].device)}

    def calibrate(self, head: Params, ss: CCVRServerState, seed: int, round_: int) -> Params:
        """The head re-trained on virtual features of the class Gaussians (CCVR Sec. 4)."""
        z, y = virtual_features(ss.mu, ss.factor, ss.usable, self.cfg.virtual_per_class, seed, round_)
        return fit_linear(head, z, y, optimizer="sgd", lr=self.calib_lr, epochs=self.cfg.calib_epochs,
                          batch_size=self.calib_bs, key=(seed, round_, 0xCC))

    def predict(self, cs: CCVRClientState, ss: CCVRServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        M = x.shape[0]
        cal = logits(expand(ss.calibrated, M), x, 0)
        out = {"main": cal, "fedavg": logits(expand(ss.lp.params, M), x, 0)}  # "fedavg": the head before calibration
        if self.cfg.head is None:
            out["local_model"] = logits(cs.lp.params, x, 0)
        return out

    def secure_form(self, message: object = None) -> SecureForm:
        """Under SecAgg+ the server sees the sums of the class statistics (CCVR Sec. 4, as sums) and
        of the n_k-weighted FedAvg deltas with their weights; only the flags saying whose
        statistics are new travel in the clear (the server learns who has reported, not what).
        Counts are an integer field (rounded back after SecAgg+'s dequantisation); under DP the
        private wrapper leaves their noisy totals unclamped (`clamp_noisy_counts`) and the presence
        of a class is decided on the running total of the noisy counts (module docstring)."""
        def sums(m: CCVRMessage | DeltaMessage | Empty) -> dict[str, torch.Tensor]:
            if isinstance(m, Empty):  # a saved head, every statistic in: nothing is sent
                return {}
            d = m.lp if isinstance(m, CCVRMessage) else m
            out: dict[str, torch.Tensor] = {}
            if d is not None:
                out = {f"wdelta.{k}": d.weight[0].double() * v[0].double() for k, v in d.delta.items()}
                out["weight"] = d.weight[:1].double()  # [1]: the secure sums are arrays
            if isinstance(m, CCVRMessage):
                out.update(sums=m.sums[0], sq=m.sq[0], counts=m.counts[0].double())
            return out

        def clear(m: CCVRMessage | DeltaMessage) -> CCVRFresh | None:
            return CCVRFresh(m.fresh) if isinstance(m, CCVRMessage) else None

        def aggregate(ss: CCVRServerState, flags: CCVRFresh | None, tot: dict[str, torch.Tensor],
                      ctx: RoundCtx) -> tuple[CCVRServerState, CCVRBroadcast]:
            if not tot and flags is None:  # the Empty round of a saved head
                return self._idle(ss)
            d = None
            if "weight" in tot:
                w = tot["weight"]
                delta = {k[len("wdelta."):]: (v / w).float()[None] for k, v in tot.items() if k.startswith("wdelta.")}
                d = DeltaMessage(delta, {}, w.float().view(1))
            if flags is not None:
                ss = self._collect(ss, tot["sums"], tot["sq"], tot["counts"].round().to(torch.int64), flags.fresh, ctx)
            return self._step(ss, d, ctx)

        return SecureForm(sums, ("counts",), clear, aggregate)

    def dp_sensitivity(self, clip: float) -> dict[str, float]:
        """One example, its feature x clipped to ||x|| <= clip, moves one class's sum s_c by x
        (L2 norm clip), its q_c by x x^T (Frobenius norm ||x||^2 = clip^2) and its count by 1:
        differential privacy of the statistics (CCVR Sec. 4, as sums) when nothing else is sent,
        i.e. when a saved head is calibrated. Refused (one line) where the message holds more."""
        if self.cfg.head is None:
            raise UserError("dp: ccvr trains its FedAvg-LP head here, whose SGD deltas are not clipped sums; "
                            "calibrate a saved head trained under DP instead (e.g. a fed3r run with --dp-*): "
                            "--set head=RUN_DIR")
        if self.cfg.covariance != "paper":
            raise UserError("dp: ccvr covariance='fl-bench' sends (n-1)/n q_kc + mu_kc mu_kc^T per client, which is "
                            "not a sum over the client's examples (it rescales and recentres all of them), so a "
                            "sum's per-example sensitivity does not bound it; use covariance='paper'")
        c = float(clip)
        return {"sums": c, "sq": c * c, "counts": 1.0}

    def dp_finalize(self, noise_std: dict[str, float], spec: DataSpec) -> dict[str, Any]:
        """The saved head's own privacy (its run's results.json `privacy` block, None when it was
        trained without DP, with a warning: the calibrated head then is not private). The noisy counts
        reach `secure_form`'s aggregate unclamped (`clamp_noisy_counts`)."""
        import json
        from pathlib import Path

        try:
            saved = json.loads((Path(str(self.cfg.head)) / "results.json").read_text()).get("privacy")
        except (OSError, ValueError, AttributeError):
            saved = None
        if not saved:
            log.warning("ccvr: head=%s was trained without differential privacy: the calibrated head is not "
                        "private (this run's epsilon covers the class statistics only)", self.cfg.head)
        return {"calibrated_head": str(self.cfg.head),
                "calibrated_head_privacy": None if not saved else
                {k: saved.get(k) for k in ("mechanism", "mode", "epsilon", "epsilon_all_seeds", "delta",
                                           "noise_multiplier", "releases_per_example", "accountant")}}

    def trainable_params(self, cs: CCVRClientState) -> int:
        return 0 if self.cfg.head is not None else count_params(cs.lp.params)


def saved_linear_head(tr: Any, where: str, dim: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [D, C], b [C]) of a saved run's global rule (`tr`: fedheads.run.saved.Trained), read off
    its `predict` at x = 0 and at the unit vectors; a class the rule never predicts (-inf) gets a
    zero column and bias; UserError (one line, naming `where`) when the run does not fit or its
    rule is not x W + b."""
    rule = tr.alg.global_rule
    if rule is None:
        raise UserError(f"{where}: {tr.alg.name} has no global model to calibrate (its heads are per client)")
    if tr.dim != dim or len(tr.classes) != num_classes:
        raise UserError(f"{where}: a head for {tr.dim}-d features and {len(tr.classes)} classes; this store has "
                        f"{dim}-d features and {num_classes} classes")
    M = len(tr.clients)

    def scores(x: torch.Tensor) -> torch.Tensor:
        xs = x.to(tr.device, torch.float32).unsqueeze(0).expand(M, -1, -1)
        with torch.no_grad():
            out = tr.alg.predict(tr.client_state, tr.server_state, xs, torch.ones(xs.shape[:2], dtype=torch.bool))
        return out[rule][0].double().cpu()

    probe = torch.randn(8, dim, generator=torch.Generator().manual_seed(0))
    s, got = scores(torch.cat([torch.zeros(1, dim), torch.eye(dim)])), scores(probe)
    # a class the head never predicts (score -inf everywhere: absent, e.g. no count under DP) starts at a
    # zero column and bias, as the algorithms' own `linear_head` hands such a class to fine-tuning
    absent = torch.isneginf(s).all(0) & torch.isneginf(got).all(0)
    s, got = s.masked_fill(absent, 0.0), got.masked_fill(absent, 0.0)
    b, w = s[0], s[1:] - s[0]
    want = probe.double() @ w + b
    if not bool(torch.isfinite(s).all()) or not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        raise UserError(f"{where}: {tr.alg.name}'s rule {rule!r} is not a linear head (scores x W + b), which CCVR "
                        "re-trains; calibrate a run of lp, fedavg-linear, ccvr or fedpft")
    if bool(absent.any()):
        log.info("ccvr: %s: %d class(es) the saved head never predicts start the calibration at zero weights",
                 where, int(absent.sum()))
    return w.float(), b.float()


def _head(params: Params) -> Params:
    return {"cls.weight": params["cls.weight"], "cls.bias": params["cls.bias"]}


def _factory(**kw: object) -> CCVR:
    return CCVR(config_from_kwargs(CCVRConfig, kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("ccvr", _factory, description=CCVR.description, config=CCVR.config)
