"""AFL (He et al., "AFL: A Single-Round Analytic Approach for Federated Learning with Pre-trained
Models", CVPR 2025) on cached features: one round, each client solves its own regularised least
squares on the frozen features, the server combines the clients' solutions so that the result
does not depend on how the rows are split among them. The details follow the authors' code
(ZHUANGHP/Analytic-federated-learning afl.py, main.py, run.sh), cited below by function.

Client k (``local_update``): C_k = X_kᵀX_k + γI and its local solution W_k = C_k⁻¹ X_kᵀY_k [D, C]
(Y_k one-hot, no bias column, raw features); it sends W_k and C_k. The server's absolute
aggregation law (``aggregation``, applied pairwise there) is, in closed form,

    W = (Σ_k C_k)⁻¹ Σ_k C_k W_k = (XᵀX + KγI)⁻¹ XᵀY            (sums, then a finalize)

over the K clients received: the pooled ridge regression with penalty Kγ. Regularisation
cleaning (``clean_regularization``, ``--clean_reg`` in run.sh) removes the Kγ the clients added:

    W_clean = (Σ_k C_k − KγI)⁻¹ Σ_k C_k W_k = (XᵀX)⁻¹ XᵀY,

the pooled least squares, whatever the partition (the paper's invariance; `lam` keeps a penalty
λ there instead, the pooled ridge regression with λ). The head scores x·W; no normalisation.

Against Fed3R (fed3r.py), which also solves a ridge regression of summed Grams in one round: AFL
has no bias column, each client regularises its own Gram (γ per client, K γ in the sum, cleaned
away), the clients send their solutions W_k (and C_k) rather than XᵀY, and the class weights are
not normalised. With `clean` and λ = lam, AFL equals Fed3R with bias=False and the same λ before
Fed3R's normalisation (a test).

Ill-posed: with fewer pooled rows than dimensions (100 rows of 1280-d features), XᵀX is singular
and the authors' cleaning inverts it anyway (``torch.inverse``): the result is rounding noise.
By default (``solve="stable"``) a cleaned system whose smallest eigenvalue is below D·eps of its
largest is solved with the pseudo-inverse instead (the minimum-norm least squares, the λ → 0
limit of the ridge regression, again independent of the partition), and a note says so;
``solve="literal"`` keeps the authors' inverse and Woodbury form.

Messages are sums after the client's local solve (C_k and C_kW_k = X_kᵀY_k up to rounding), so the
server step runs under SecAgg+, and under differential privacy with the Gaussian mechanism on the
clipped sums: one example moves X_kᵀX_k by xxᵀ (Frobenius norm clip²) and X_kᵀY_k by x·e_yᵀ (clip);
the noisy Gram is symmetrised and, as Fed3R does, a penalty κσ√D is added so that the noisy system
stays positive definite (σ: the Gram's noise std per entry; `lam_noise_scale` = κ)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms.fed3r import client_gram, linear_head
from fedheads.algorithms.fedncm import class_scores, client_stats
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm

SOLVES = ("stable", "literal")


@dataclass(frozen=True)
class AFLConfig:
    """AFL settings (the defaults of the authors' run.sh: --rg 1 --clean_reg)."""

    gamma: float = setting(1.0, "regularisation gamma each client adds to its Gram (C_k = X_k^T X_k + gamma I)",
                           source="run.sh --rg 1; afl.py local_update")
    clean: bool = setting(True, "regularisation cleaning: remove the K gamma the clients added (False: keep the "
                          "pooled ridge with penalty K gamma)", source="run.sh --clean_reg; afl.py clean_regularization")
    lam: float = setting(0.0, "penalty kept after cleaning (0: the pooled least squares, as the authors' code)",
                         source="ours")
    solve: str = setting("stable", "stable: a singular cleaned system is solved with the pseudo-inverse (minimum-norm "
                         "least squares) and a note says so | literal: the authors' inverse and Woodbury form",
                         source="ours; afl.py clean_regularization")
    lam_noise_scale: float = setting(2.0, "under DP: penalty lam + lam_noise_scale * sigma_gram * sqrt(R D) (as Fed3R's)",
                                     source="ours (fed3r.py)")

    def __post_init__(self) -> None:
        if not (self.gamma >= 0 and self.lam >= 0 and self.lam_noise_scale >= 0):
            raise UserError(f"gamma {self.gamma} / lam {self.lam} / lam_noise_scale {self.lam_noise_scale}: must be >= 0")
        if self.solve not in SOLVES:
            raise UserError(f"solve {self.solve!r}: must be one of {', '.join(SOLVES)}")
        if not self.clean and self.gamma == 0 and self.lam == 0:
            raise UserError("gamma 0 without cleaning solves X^T X alone: give gamma > 0 or clean=true")


@dataclass(frozen=True)
class AFLClientState:
    sent: torch.Tensor  # [M] bool: this client's solution has reached the server (its W_k is not kept: M D C
    # values, 114 GB at iNaturalist-Users-120K's 9,275 clients; nothing predicts with it)


@dataclass(frozen=True)
class AFLServerState:
    corr: torch.Tensor  # [D, D] float64 sum_k C_k (gamma I included)
    cross: torch.Tensor  # [D, C] float64 sum_k C_k W_k
    clients: torch.Tensor  # [] int64 K: clients whose solutions are in
    weight: torch.Tensor  # [D, C] float64 the aggregated (cleaned) W
    present: torch.Tensor  # [C] bool: class c's column of sum_k X_k^T Y_k is not zero (some client holds it;
    # under DP every class: the noise)
    pinv: torch.Tensor  # [] bool: the last solve used the pseudo-inverse (solve="stable", singular system)


@dataclass(frozen=True)
class AFLBroadcast:
    """Nothing: one round, the clients need nothing from the server."""


@dataclass(frozen=True)
class AFLMessage:
    weight: torch.Tensor  # [M, D, C] W_k
    corr: torch.Tensor  # [M, D, D] C_k = X_k^T X_k + gamma I
    fresh: torch.Tensor  # [M] int64 1 for a client sending its solution now (K counts them)

    def comm_size(self) -> tuple[int, int]:
        """(values, bytes) one client sends, averaged over the participants: W_k and C_k (float64) from
        a client sending its solution now, the flag from every one (a client that has sent sends no more)."""
        M, D, C = self.weight.shape
        values = int(self.fresh.sum()) * (D * C + D * D) + M
        return round(values / max(M, 1)), round(8 * values / max(M, 1))


@dataclass(frozen=True)
class AFLSums:
    """Many clients' contributions added (the vectorised engine's summed path, `summed_update`):
    Σ_k C_k and Σ_k C_kW_k = Σ_k X_kᵀY_k, formed from the clients' rows pooled, without the local
    solves (C_kW_k = X_kᵀY_k in exact arithmetic, also for a singular C_k: X_kᵀY_k lies in its range)."""

    corr: torch.Tensor  # [1, D, D] float64
    cross: torch.Tensor  # [1, D, C] float64
    fresh: torch.Tensor  # [1] int64 clients that sent now
    rows: torch.Tensor  # [1] int64 participants summed

    def comm_size(self) -> tuple[int, int]:
        """(values, bytes) one client sends, as in AFLMessage: W_k, C_k (float64) and its flag, for
        the clients that send; averaged over the participants."""
        D, C = self.cross.shape[1:]
        values = int(self.fresh.sum()) * (D * C + D * D) + int(self.rows.sum())
        m = max(int(self.rows.sum()), 1)
        return round(values / m), round(8 * values / m)


def aggregate_closed_form(corr: torch.Tensor, cross: torch.Tensor, k: int, cfg: AFLConfig,
                          noise_lam: float = 0.0) -> tuple[torch.Tensor, bool]:
    """(W [D, C], used the pseudo-inverse) from Σ C_k, Σ C_k W_k of K clients: the absolute
    aggregation law's closed form, then the cleaning (module docstring)."""
    D = corr.shape[0]
    eye = torch.eye(D, dtype=corr.dtype, device=corr.device)
    a = corr - (k * cfg.gamma - cfg.lam - noise_lam) * eye if cfg.clean else corr + noise_lam * eye
    a = 0.5 * (a + a.T)
    if cfg.solve == "literal":
        agg = torch.linalg.inv(corr) @ cross  # aggregation(): W = (sum C_k)^-1 sum C_k W_k
        if not cfg.clean:
            return agg, False
        r_origin = torch.linalg.inv(corr - k * cfg.gamma * eye)  # clean_regularization(), Woodbury form
        return agg + (k * cfg.gamma * r_origin) @ agg, False
    lam_all, _ = torch.linalg.eigh(a)
    top = float(lam_all.abs().max()) if lam_all.numel() else 0.0
    if top > 0 and float(lam_all.min()) > D * torch.finfo(a.dtype).eps * top:
        return torch.cholesky_solve(cross, torch.linalg.cholesky(a)), False
    return torch.linalg.pinv(a, hermitian=True) @ cross, True


class AFL(AlgorithmBase):
    """AFL in the core's algorithm protocol (one pass: every client solves and sends once)."""

    name = "afl"
    description = "AFL (He et al. CVPR 2025): clients' local least squares, aggregated exactly (absolute aggregation)"
    config = AFLConfig
    global_rule = "main"
    one_pass = True
    seed_free = True  # a deterministic function of the statistics
    sums_messages = True  # the server reads only sum_k C_k and sum_k C_k W_k
    clamp_noisy_counts = False  # K is summed exactly (no example moves it): never clamped

    def __init__(self, cfg: AFLConfig = AFLConfig()) -> None:
        self.cfg = cfg

    def init(self, spec: DataSpec, seed: int) -> Init:
        M, D, C, dev = spec.num_clients, spec.dim, spec.num_classes, spec.device
        def f64(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=dev)

        cs = AFLClientState(torch.zeros(M, dtype=torch.bool, device=dev))
        ss = AFLServerState(f64(D, D), f64(D, C), torch.zeros((), dtype=torch.int64, device=dev), f64(D, C),
                            torch.zeros(C, dtype=torch.bool, device=dev), torch.zeros((), dtype=torch.bool, device=dev))
        return Init(cs, ss, AFLBroadcast())

    def client_update(self, cs: AFLClientState, bc: AFLBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[AFLClientState, AFLMessage]:
        """local_update: C_k = X_kᵀX_k + γI, W_k = C_k⁻¹ X_kᵀY_k (each client once)."""
        C, D = data.num_classes, data.dim
        y = torch.nn.functional.one_hot(data.y_train, C).to(torch.float64) * data.m_train.unsqueeze(-1)
        x = data.x_train.to(torch.float64) * data.m_train.unsqueeze(-1)
        eye = torch.eye(D, dtype=torch.float64, device=x.device)
        corr = client_gram(data.x_train, data.m_train) + self.cfg.gamma * eye
        cross = x.transpose(1, 2) @ y  # X_k^T Y_k [M, D, C]
        chol, info = torch.linalg.cholesky_ex(corr)
        w = torch.where((info == 0).view(-1, 1, 1), torch.cholesky_solve(cross, chol),
                        torch.linalg.pinv(corr, hermitian=True) @ cross)  # gamma = 0 on a singular Gram: min-norm
        fresh = ~cs.sent.to(w.device)
        f = fresh.to(torch.float64).view(-1, 1, 1)
        msg = AFLMessage(w * f, corr * f, fresh.to(torch.int64))
        return AFLClientState(torch.ones_like(cs.sent)), msg

    def summed_update(self, cs: AFLClientState, bc: AFLBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[AFLClientState, AFLSums]:
        """Σ_k C_k and Σ_k X_kᵀY_k of the clients in `data` that have not sent, as one row from their
        rows pooled: no per-client [D, D] Gram or [D, C] solution is made."""
        M, N, D = data.x_train.shape
        fresh = ~cs.sent.to(data.m_train.device)
        rows = (data.m_train & fresh.view(-1, 1)).reshape(1, M * N)
        x = data.x_train.reshape(1, M * N, D)
        eye = torch.eye(D, dtype=torch.float64, device=x.device)
        corr = client_gram(x, rows) + int(fresh.sum()) * self.cfg.gamma * eye
        # X^T Y as per-class sums of the rows (no [rows, C] one-hot: 1.2 GB at iNaturalist's shape)
        cross = client_stats(x, data.y_train.reshape(1, M * N), rows, data.num_classes)[0].transpose(1, 2)
        n = torch.tensor([int(fresh.sum())], device=x.device)
        return AFLClientState(torch.ones_like(cs.sent)), AFLSums(corr, cross, n, torch.tensor([M], device=x.device))

    def server_aggregate(self, ss: AFLServerState, msg: AFLMessage | AFLSums,
                         ctx: RoundCtx) -> tuple[AFLServerState, AFLBroadcast]:
        if isinstance(msg, AFLSums):
            return self._finalize(ss, ss.corr + msg.corr[0], ss.cross + msg.cross[0], int(ss.clients) + int(msg.fresh.sum()),
                                  ctx)
        corr = ss.corr + msg.corr.to(torch.float64).sum(0)  # sums of client contributions ...
        cross = ss.cross + (msg.corr.to(torch.float64) @ msg.weight.to(torch.float64)).sum(0)
        return self._finalize(ss, corr, cross, int(ss.clients) + int(msg.fresh.sum()), ctx)

    def _finalize(self, ss: AFLServerState, corr: torch.Tensor, cross: torch.Tensor, k: int,
                  ctx: RoundCtx) -> tuple[AFLServerState, AFLBroadcast]:
        sigma = float((ctx.noise_std or {}).get("corr", 0.0))
        noise_lam = self.cfg.lam_noise_scale * sigma * math.sqrt((ctx.round + 1) * corr.shape[0])
        w, pinv = aggregate_closed_form(corr, cross, k, self.cfg, noise_lam) if k else (ss.weight, False)  # ... finalize
        present = (cross != 0).any(0)  # the code scores every class; one no client holds would score 0 for every x
        return AFLServerState(corr, cross, torch.tensor(k, device=corr.device), w, present,
                              torch.tensor(pinv, device=corr.device)), AFLBroadcast()

    def predict(self, cs: AFLClientState, ss: AFLServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        w = ss.weight.T  # [C, D]
        return {"main": class_scores(w, torch.zeros_like(w[:, 0]), ss.present, x)}

    def linear_head(self, ss: AFLServerState) -> dict[str, torch.Tensor]:
        """W itself, no bias (AFL+FT starts from it)."""
        return linear_head(ss.weight.T, torch.zeros(ss.weight.shape[1], dtype=torch.float64, device=ss.weight.device))

    def trained_notes(self, ss: AFLServerState, classes: list[str]) -> list[str]:
        if not bool(ss.present.any()):
            raise UserError("afl: no client sent a solution (run at least one round)")
        if bool(ss.pinv):
            return ["afl: the cleaned system sum_k X_k^T X_k is singular (fewer pooled rows than dimensions); solved "
                    "with the pseudo-inverse, the minimum-norm least squares (--set solve=literal inverts it as the "
                    "authors' code does; --set lam=L keeps a ridge penalty)"]
        return []

    def secure_form(self, message: object = None) -> SecureForm:
        """Under SecAgg+ the server sees Σ_k C_k, Σ_k C_kW_k (= Σ_k X_kᵀY_k) and K."""

        def sums(m: AFLMessage) -> dict[str, torch.Tensor]:
            corr = m.corr[0].to(torch.float64)
            return {"corr": corr, "cross": corr @ m.weight[0].to(torch.float64), "clients": m.fresh[:1].double()}

        def agg(ss: AFLServerState, clear: object, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple:
            corr = ss.corr + 0.5 * (tot["corr"] + tot["corr"].T)  # symmetric part (a noisy sum is not symmetric)
            return self._finalize(ss, corr, ss.cross + tot["cross"], int(ss.clients) + int(tot["clients"].round().sum()),
                                  ctx)

        return SecureForm(sums, ("clients",), lambda m: None, agg)

    def dp_sensitivity(self, clip: float) -> dict[str, float]:
        """One example, clipped to norm `clip`, moves C_k by xxᵀ (||.||_F = clip²) and X_kᵀY_k by x e_yᵀ
        (clip); K is public (the participants)."""
        c = float(clip)
        return {"corr": c * c, "cross": c, "clients": 0.0}

    def dp_finalize(self, noise_std: dict[str, float], spec: DataSpec) -> dict[str, Any]:
        sigma = float(noise_std.get("corr", 0.0))
        return {"afl_noise_lam": self.cfg.lam_noise_scale * sigma * math.sqrt(spec.dim),
                "afl_noise_lam_rule": "lam_noise_scale * corr_noise_std * sqrt(R * D), added to the cleaned system"}

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """Up: W_k (D·C) and C_k (D²); down: the aggregated W (D·C)."""
        D, C = arch.in_dim, arch.num_classes
        return PaperRoundComm(D * C + D * D, D * C)

    def trainable_params(self, cs: AFLClientState) -> int:
        return 0  # solved in closed form


def _factory(**kw: object) -> AFL:
    return AFL(AFLConfig(**kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("afl", _factory, description=AFL.description, config=AFL.config)
