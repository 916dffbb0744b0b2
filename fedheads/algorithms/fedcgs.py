"""FedCGS (Guan, Zhou & Gu, "Capture Global Feature Statistics for One-Shot Federated Learning",
AAAI 2025; arXiv 2503.06962) on cached features: one round, each client sends sums of its
features, the server builds a Gaussian classifier with one shared covariance from the global
statistics. The details follow the authors' code (Yuqin-G/FedCGS main_fedcgs.py and utils_fl.py
``eval_lda``), cited below by name.

Client k sends its class sums cs_kc = Σ x over its rows of class c, its counts cc_kc, its Ax_k = Σ x
and its Bx_k = Σ xxᵀ (main_fedcgs.py, accumulated in float64). Ax_k is the sum of its class sums,
so it is not sent here (the server adds the class sums). The server forms, with N = Σ_c N_c,

    μ = A/N,   S = (B − μAᵀ − Aμᵀ + N μμᵀ)/(N − 1)       (the global covariance of all features)
    Ŝ = S + γI,   w_c = Ŝ⁻¹ μ_c,   b_c = −½ μ_cᵀ Ŝ⁻¹ μ_c + log(N_c / N)      (eval_lda)

with μ_c = A_c / N_c the class means, and scores x·w_c + b_c: the Gaussian classifier with the
shared covariance S. A class no client holds has log 0 = −inf and is never predicted (as in the
code). ``gamma`` is 0 in the code (``gamma_list = [0]``), which inverts S itself.

Ill-posed: S has rank at most N − 1, so with N <= D (100 rows of 1280-d features) Ŝ is singular at
γ = 0 and the code's ``np.linalg.inv`` returns rounding noise. By default (``solve="stable"``) a
system whose smallest eigenvalue is below D·eps of its largest is solved with the pseudo-inverse
(the minimum-norm solution, the γ → 0 limit) and a note says so; ``solve="literal"`` keeps the
code's inverse.

Personalisation. The paper extends FedCGS to personalised FL: each client downloads the global
statistics in one more round. The code has no personalised part and the paper was not at hand;
our reading, stated: client k keeps the shared Gaussians (μ_c, S) and replaces the global class
prior by its own, log((n_kc + s)/(n_k + C s)) with Laplace smoothing s = ``prior_smoothing`` (the
Bayes rule under label shift with shared class-conditionals); ``predict``'s "personal" rule. The
engine's evaluation reads the server state; a deployment downloads μ_c, the counts and S (C·D + C
+ D² values, ``paper_round_comm``'s download) in that round.

Messages are sums over examples (class_items.ClassItems: the classes a client holds as items, the
Gram once), so the server step runs under SecAgg+ and under differential privacy with the
Gaussian mechanism: one example moves a class sum by x (clip), a count by 1 and B by xxᵀ (clip²).
The noisy S then is not positive semidefinite; as Fed3R does, a penalty κσ√(R D)/(N − 1) is added
to its diagonal (σ: B's noise std per entry; κ = ``lam_noise_scale``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms.class_items import ClassItems, ClassTotals, class_items, pooled_totals
from fedheads.algorithms.fed3r import linear_head
from fedheads.algorithms.fedncm import class_scores
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm

SOLVES = ("stable", "literal")
MOMENTS = ("sums",)


@dataclass(frozen=True)
class FedCGSConfig:
    """FedCGS settings (main_fedcgs.py's values where it has them)."""

    gamma: float = setting(0.0, "ridge gamma added to the global covariance (S + gamma I)",
                           source="main_fedcgs.py gamma_list = [0]")
    solve: str = setting("stable", "stable: a singular system is solved with the pseudo-inverse and a note says so | "
                         "literal: the code's inverse", source="ours; main_fedcgs.py np.linalg.inv")
    prior_smoothing: float = setting(1.0, "Laplace smoothing s of each client's own class prior in the personal rule "
                                     "(0: its frequencies; a class it lacks is then never predicted)", source="ours")
    lam_noise_scale: float = setting(2.0, "under DP: gamma + lam_noise_scale * sigma_gram * sqrt(R D) / (N - 1)",
                                     source="ours (fed3r.py)")

    def __post_init__(self) -> None:
        if not (self.gamma >= 0 and self.prior_smoothing >= 0 and self.lam_noise_scale >= 0):
            raise UserError(f"gamma {self.gamma} / prior_smoothing {self.prior_smoothing} / lam_noise_scale "
                            f"{self.lam_noise_scale}: must be >= 0")
        if self.solve not in SOLVES:
            raise UserError(f"solve {self.solve!r}: must be one of {', '.join(SOLVES)}")


@dataclass(frozen=True)
class FedCGSClientState:
    sent: torch.Tensor  # [M] bool: this client's statistics have reached the server
    counts: torch.Tensor  # [M, C] int64 its own class counts (the personal prior)


@dataclass(frozen=True)
class FedCGSServerState:
    sums: torch.Tensor  # [C, D] float64 A_c = sum_k cs_kc
    counts: torch.Tensor  # [C] int64 N_c
    gram: torch.Tensor  # [D, D] float64 B = sum_k Bx_k
    clients: torch.Tensor  # [] int64 clients whose statistics are in
    weight: torch.Tensor  # [D, C] float64 w_c = S_hat^-1 mu_c
    quad: torch.Tensor  # [C] float64 -1/2 mu_c^T S_hat^-1 mu_c
    present: torch.Tensor  # [C] bool N_c >= 1
    pinv: torch.Tensor  # [] bool: the last solve used the pseudo-inverse


@dataclass(frozen=True)
class FedCGSBroadcast:
    """Nothing: one round, the clients need nothing from the server."""


def global_gaussian(sums: torch.Tensor, counts: torch.Tensor, gram: torch.Tensor, gamma: float, solve: str,
                    noise_lam: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(W [D, C], -1/2 mu_c^T S_hat^-1 mu_c [C], used the pseudo-inverse) from the summed statistics."""
    C, D = sums.shape
    n = counts.clamp(min=0).to(torch.float64)
    N = float(n.sum())
    A = sums.sum(0)  # Ax: the sum of the class sums
    mu = A / max(N, 1.0)
    s = (gram - torch.outer(mu, A) - torch.outer(A, mu) + N * torch.outer(mu, mu)) / max(N - 1.0, 1.0)
    s = 0.5 * (s + s.T) + (gamma + noise_lam) * torch.eye(D, dtype=s.dtype, device=s.device)  # S_hat
    means = sums / n.clamp(min=1).unsqueeze(1)  # class_means
    pinv = False
    if solve == "literal":
        w = torch.linalg.inv(s) @ means.T
    else:
        lam = torch.linalg.eigvalsh(s)
        top = float(lam.abs().max()) if lam.numel() else 0.0
        if top > 0 and float(lam.min()) > D * torch.finfo(s.dtype).eps * top:
            w = torch.cholesky_solve(means.T, torch.linalg.cholesky(s))
        else:
            w, pinv = torch.linalg.pinv(s, hermitian=True) @ means.T, True
    return w, -0.5 * (means * w.T).sum(1), pinv


class FedCGS(AlgorithmBase):
    """FedCGS in the core's algorithm protocol (one pass: every client sends its statistics once)."""

    name = "fedcgs"
    description = ("FedCGS (Guan et al. AAAI 2025): Gaussian classifier with the global feature covariance from "
                   "summed client statistics, and a personal class prior per client")
    config = FedCGSConfig
    global_rule = "main"
    one_pass = True
    seed_free = True  # a deterministic function of the statistics
    sums_messages = True  # the server reads only the sums over clients
    clamp_noisy_counts = False  # presence is decided on the running total of the noisy counts

    def __init__(self, cfg: FedCGSConfig = FedCGSConfig()) -> None:
        self.cfg = cfg
        self.num_classes: int | None = None  # set by init: the secure form makes a client's classes dense

    def init(self, spec: DataSpec, seed: int) -> Init:
        M, D, C, dev = spec.num_clients, spec.dim, spec.num_classes, spec.device
        self.num_classes = C

        def f64(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=dev)

        def i64(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=dev)

        cs = FedCGSClientState(torch.zeros(M, dtype=torch.bool, device=dev), i64(M, C))
        ss = FedCGSServerState(f64(C, D), i64(C), f64(D, D), i64(), f64(D, C), f64(C),
                               torch.zeros(C, dtype=torch.bool, device=dev), torch.zeros((), dtype=torch.bool, device=dev))
        return Init(cs, ss, FedCGSBroadcast())

    def _local_counts(self, cs: FedCGSClientState, data: FedData, fresh: torch.Tensor) -> torch.Tensor:
        M, C = cs.counts.shape
        y = torch.where(data.m_train, data.y_train, torch.full_like(data.y_train, C))
        own = torch.zeros(M, C + 1, dtype=torch.int64, device=y.device).scatter_add_(1, y, torch.ones_like(y))[:, :C]
        return torch.where(fresh.view(-1, 1).to(own.device), own, cs.counts.to(own.device))

    def client_update(self, cs: FedCGSClientState, bc: FedCGSBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedCGSClientState, ClassItems]:
        """main_fedcgs.py's per-client loop, once per client: cs, cc (and Bx)."""
        fresh = ~cs.sent.to(data.m_train.device)
        msg = class_items(data.x_train, data.y_train, data.m_train & fresh.view(-1, 1), data.num_classes, MOMENTS, fresh)
        return FedCGSClientState(torch.ones_like(cs.sent), self._local_counts(cs, data, fresh)), msg

    def summed_update(self, cs: FedCGSClientState, bc: FedCGSBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[FedCGSClientState, ClassTotals]:
        fresh = ~cs.sent.to(data.m_train.device)
        tot = pooled_totals(data.x_train, data.y_train, data.m_train & fresh.view(-1, 1), data.num_classes, MOMENTS,
                            fresh)
        return FedCGSClientState(torch.ones_like(cs.sent), self._local_counts(cs, data, fresh)), tot

    def server_aggregate(self, ss: FedCGSServerState, msg: ClassItems | ClassTotals,
                         ctx: RoundCtx) -> tuple[FedCGSServerState, FedCGSBroadcast]:
        t = msg if isinstance(msg, ClassTotals) else msg.totals(ss.sums.shape[0])
        return self._absorb(ss, t.items["sums"][0], t.counts[0], t.whole["gram"][0], int(t.clients.sum()), ctx)

    def _absorb(self, ss: FedCGSServerState, sums: torch.Tensor, counts: torch.Tensor, gram: torch.Tensor,
                clients: int, ctx: RoundCtx) -> tuple[FedCGSServerState, FedCGSBroadcast]:
        if clients == 0:  # nothing new: the head stays as it is
            return ss, FedCGSBroadcast()
        dev = ss.sums.device
        sums, counts = ss.sums + sums.to(dev, torch.float64), ss.counts + counts.to(dev, torch.int64)  # sums ...
        gram = ss.gram + gram.to(dev, torch.float64)
        sigma = float((ctx.noise_std or {}).get("gram", 0.0))
        N = float(counts.clamp(min=0).sum())
        noise_lam = self.cfg.lam_noise_scale * sigma * math.sqrt((ctx.round + 1) * gram.shape[0]) / max(N - 1.0, 1.0)
        w, quad, pinv = global_gaussian(sums, counts, gram, self.cfg.gamma, self.cfg.solve, noise_lam)  # ... finalize
        k = torch.tensor(int(ss.clients) + clients, device=dev)
        return FedCGSServerState(sums, counts, gram, k, w, quad, counts >= 1, torch.tensor(pinv, device=dev)), \
            FedCGSBroadcast()

    def _bias(self, ss: FedCGSServerState) -> torch.Tensor:
        n = ss.counts.clamp(min=0).to(torch.float64)
        return ss.quad + torch.log(n / n.sum().clamp(min=1))  # log(N_c / N): -inf for a class no client holds

    def predict(self, cs: FedCGSClientState, ss: FedCGSServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if not bool(ss.present.any()):
            raise UserError("fedcgs: no statistics yet (run at least one round)")
        main = class_scores(ss.weight.T, self._bias(ss), ss.present, x)
        n = cs.counts.to(x.device, torch.float64)
        s, C = self.cfg.prior_smoothing, n.shape[1]
        own = torch.log((n + s) / (n.sum(1, keepdim=True) + C * s).clamp(min=1e-300))  # [M, C]
        personal = class_scores(ss.weight.T, ss.quad, ss.present, x) + own.unsqueeze(1).to(main.dtype)
        return {"main": main, "personal": personal}

    def linear_head(self, ss: FedCGSServerState) -> dict[str, torch.Tensor]:
        """The global head (FedCGS+FT); a class no client holds starts at a zero column and a bias
        below every other class's (log 0 itself is no start for training)."""
        b = self._bias(ss)
        floor = float(b[ss.present].min()) - 1e3 if bool(ss.present.any()) else 0.0
        return linear_head(ss.weight.T, torch.where(ss.present, b, torch.full_like(b, floor)))

    def trained_notes(self, ss: FedCGSServerState, classes: list[str]) -> list[str]:
        if not bool(ss.present.any()):
            raise UserError("fedcgs: no client sent statistics (run at least one round)")
        notes = []
        if bool(ss.pinv):
            notes.append("fedcgs: the global covariance is singular (no more pooled rows than dimensions, gamma = 0); "
                         "solved with the pseudo-inverse (--set solve=literal inverts it as the authors' code does; "
                         "--set gamma=G adds a ridge)")
        missing = [classes[c] if c < len(classes) else str(c) for c in (~ss.present).nonzero().view(-1).tolist()]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            notes.append(f"fedcgs: no client holds class(es) {shown}: the global head never predicts them")
        return notes

    def secure_form(self, message: object = None) -> SecureForm:
        """Under SecAgg+ the server sees the dense totals of the class sums, the counts, B and the
        number of clients that sent."""

        def sums(m: ClassItems) -> dict[str, torch.Tensor]:
            if self.num_classes is None:
                raise UserError("fedcgs: secure_form's sums need the number of classes, which init sets")
            t = m.totals(self.num_classes)
            return {"sums": t.items["sums"][0], "counts": t.counts[0].double(), "gram": t.whole["gram"][0],
                    "clients": t.clients.double()}

        def agg(ss: FedCGSServerState, clear: object, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple:
            gram = 0.5 * (tot["gram"] + tot["gram"].T)  # the symmetric part (a noisy sum is not symmetric)
            return self._absorb(ss, tot["sums"], tot["counts"].round().to(torch.int64), gram,
                                int(tot["clients"].round().sum()), ctx)

        return SecureForm(sums, ("counts", "clients"), lambda m: None, agg)

    def dp_sensitivity(self, clip: float) -> dict[str, float]:
        """One example, clipped to ||x|| <= clip, moves a class sum by x (clip), a count by 1 and B by
        xxᵀ (||.||_F = clip²); the number of clients is public."""
        c = float(clip)
        return {"sums": c, "counts": 1.0, "gram": c * c, "clients": 0.0}

    def dp_finalize(self, noise_std: dict[str, float], spec: DataSpec) -> dict[str, Any]:
        return {"fedcgs_noise_lam_rule": "lam_noise_scale * gram_noise_std * sqrt(R * D) / (N - 1), added to S"}

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """Up: cs, cc, Ax, Bx of main_fedcgs.py (C·D + C + D + D²); down: the global statistics of the
        personalisation round (C·D + C + D²)."""
        D, C = arch.in_dim, arch.num_classes
        return PaperRoundComm(C * D + C + D + D * D, C * D + C + D * D)

    def trainable_params(self, cs: FedCGSClientState) -> int:
        return 0  # computed in closed form


def _factory(**kw: object) -> FedCGS:
    return FedCGS(FedCGSConfig(**kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fedcgs", _factory, description=FedCGS.description, config=FedCGS.config)
