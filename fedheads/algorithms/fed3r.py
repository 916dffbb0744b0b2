"""Fed3R (Fanì et al., "Accelerating Heterogeneous Federated Learning with Closed-form
Classifiers", ICML 2024): a ridge-regression classifier of the frozen features, in closed form
from statistics summed over clients.

Client k sends, once, A_k = Φ̃_kᵀΦ̃_k and b_k = Φ̃_kᵀ Y_k, with Φ̃ = [x, 1] (the bias column of the
authors' code, Erosinho13/Fed3R src/fed3r.py ``fed3r_step``) and Y_k the one-hot labels; b_k is
sent as its two parts, the per-class feature sums (C x D) and the class counts (its bias row).
The server solves the ridge regression [W; bias] = (λI + Σ_k A_k)⁻¹ Σ_k b_k (``calc_ridge_params``)
and divides W's column of each class, and its bias, by that column's norm (``normalize_W``; a
zero norm becomes 1e-6 there, here an absent class keeps a zero column and is never predicted).
The prediction is argmax_c x·w_c + bias_c.

``bias=False`` is Fed3R as FedCOF's code runs it (dipamgoswami/FedCOF federate_classes.py
``Fed3RClient``/``Fed3RServer``): G_k = X_kᵀX_k without a bias column, B_k the class sums,
W = (Σ_k G_k + λI)⁻¹ B with each class's weight normalised, no bias.

Sums of client contributions plus a finalize, so the order and grouping of clients changes the
head only by float64 rounding (the paper's order invariance), and SecAgg+ adds the same sums.
Grams accumulate in float64 (``dtype`` sets only what is sent). The solve factorises λI + ΣA_k
with Cholesky; where it is not positive definite (λ = 0 and too few samples) the solve falls
back to the pseudo-inverse, logs a warning and sets ``pinv`` in the server state.

With partial participation (fraction < 1) run enough rounds to reach every client, as FedNCM: a
client that has contributed sends zeros, the server re-solves after every round, and each
round's evaluation is the accuracy after the clients seen so far (the paper's curves of
accuracy against clients).

Differential privacy (fedheads.privacy): one example moves A by φ̃φ̃ᵀ, b's parts by x and 1
(`dp_sensitivity`), and the server solves from totals carrying Gaussian noise, N(0, σ²) iid per
entry of ΣA_k (σ = the Gram's noise std). The secure form symmetrises the noisy Gram, ½(G + Gᵀ),
before the solve (post-processing of the released matrix, so the sensitivity of the full matrix,
||φ̃φ̃ᵀ||_F = ||φ̃||², stays the one accounted): the Cholesky factorisation reads one triangle, and
the symmetric part halves the off-diagonal noise variance. The noise E = ½(N + Nᵀ) is not positive
semidefinite: ||E|| <= ||N||, and a D' x D' matrix N of iid N(0, σ²) entries has
||N|| <= (2√D' + t)σ with probability >= 1 - 2 exp(-t²/2) (Vershynin, "Introduction to the
Non-asymptotic Analysis of Random Matrices", 2012, Cor. 5.35). A fixed λ = 0.01 therefore leaves
λI + ΣA_k + E indefinite; ``lam_noise_scale`` = κ (default 2) sets, under DP, λ = lam + κ σ √D', and
κ >= 2 + √(2 log(2/β) / D') makes the system positive definite with probability >= 1 - β (ΣA_k
is positive semidefinite; E's own norm is nearer √2 σ√D', a GOE's, so κ = 2 is already ample).
Every round adds a fresh draw to the totals (fedheads.privacy), so after R rounds (partial
participation) the noise's std per entry is σ√R and the solve uses λ = lam + κ σ √(R D').
σ comes with the totals (RoundCtx.noise_std, from the private wrapper), not from the algorithm
object, so one Fed3R object runs with DP and then without as two fresh objects would. The λ used
is in results.json's privacy block (``post_processing``). Without DP nothing changes.

Under DP, whether a class is present is itself a statistic of the data, so only the noisy counts
decide it, on their running total as without DP: counts (each round's noisy total rounded to an
integer) summed over the collecting rounds, a class present where the total is >= 1. Fed3R
declares `clamp_noisy_counts = False`: the private wrapper's per-round clamp to >= 1 would make
every class present (with a weight column of pure noise where no client holds it) and, under
partial participation, add up to one count per round to b's bias row. The unclamped counts are
unbiased; a class whose true count is small against the count noise's std (σ√R) may be lost,
as one that no client holds may be kept with a noise column."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from embedcache.errors import UserError
from fedheads.algorithms.fedncm import class_scores, client_stats
from fedheads.core.config import setting
from fedheads.core.federation import DataSpec, FedData
from fedheads.core.protocol import AlgorithmBase, HeadArch, Init, PaperRoundComm, RoundCtx, SecureForm

log = logging.getLogger(__name__)

DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass(frozen=True)
class Fed3RConfig:
    """Fed3R settings."""

    lam: float = setting(0.01, "ridge penalty lambda added to the summed Gram before the solve",
                         source="Fed3R method section; lambda_ = 0.01 in Erosinho13/Fed3R's configs")
    bias: bool = setting(True, "bias column phi = [x, 1] as the Fed3R repository; False: G = X^T X, no bias, "
                               "as FedCOF's code runs Fed3R", source="Erosinho13/Fed3R fed3r_step; "
                                                                     "dipamgoswami/FedCOF Fed3RServer")
    dtype: str = setting("float64", "dtype of the statistics sent (they accumulate in float64): float64 | float32")
    lam_noise_scale: float = setting(2.0, "under DP: lambda = lam + lam_noise_scale * sigma_gram * sqrt(R D'), sigma_gram "
                                     "the Gram's noise std per entry and round, R rounds; >= 2 keeps the noisy system "
                                     "positive definite w.h.p. (module docstring); 0: lam alone (indefinite under DP); "
                                     "no effect without DP",
                                     source="ours (Vershynin 2012, Cor. 5.35)")


@dataclass(frozen=True)
class Fed3RClientState:
    sent: torch.Tensor  # [M] bool: this client's statistics have reached the server


@dataclass(frozen=True)
class Fed3RServerState:
    gram: torch.Tensor  # [D', D'] float64 sum_k A_k (D' = D + 1 with the bias column), without lambda
    sums: torch.Tensor  # [C, D] float64 sum_k of per-class feature sums (b's feature rows, transposed)
    counts: torch.Tensor  # [C] int64 samples per class (b's bias row)
    weight: torch.Tensor  # [C, D] float64 normalised ridge weights w_c (zero for absent classes)
    bias: torch.Tensor  # [C] float64 normalised bias (zeros with bias=False)
    present: torch.Tensor  # [C] bool: counts >= 1 (some client holds class c; under DP the noisy total)
    pinv: torch.Tensor  # [] bool: the last solve fell back to the pseudo-inverse


@dataclass(frozen=True)
class Fed3RBroadcast:
    """Nothing: the frozen backbone is already on the clients (features are cached)."""


@dataclass(frozen=True)
class Fed3RMessage:
    gram: torch.Tensor  # [M, D', D'] A_k = phi^T phi
    sums: torch.Tensor  # [M, C, D] per-class feature sums
    counts: torch.Tensor  # [M, C] int64 samples per class


def client_gram(x: torch.Tensor, mask: torch.Tensor, block_rows: int = 1024) -> torch.Tensor:
    """X_kᵀX_k [M, D, D] in float64 of stacked clients x [M, N, D] (padding rows masked out),
    accumulated over blocks of rows so that the float64 copy stays small."""
    M, N, D = x.shape
    g = torch.zeros(M, D, D, dtype=torch.float64, device=x.device)
    for a in range(0, N, block_rows):
        xb = x[:, a:a + block_rows].to(torch.float64) * mask[:, a:a + block_rows].unsqueeze(-1)
        g.baddbmm_(xb.transpose(1, 2), xb)
    return g


def with_bias_column(gram: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[[XᵀX, Xᵀ1], [1ᵀX, n]] = Φ̃ᵀΦ̃ for Φ̃ = [X, 1], from XᵀX [..., D, D], the class sums
    [..., C, D] and counts [..., C]."""
    s = sums.sum(-2).unsqueeze(-1)  # [..., D, 1] = Xᵀ1
    n = counts.sum(-1).to(gram.dtype)[..., None, None]
    return torch.cat([torch.cat([gram, s], -1), torch.cat([s.transpose(-1, -2), n], -1)], -2)


def solve_psd(a: torch.Tensor, b: torch.Tensor, what: str, hint: str = "") -> tuple[torch.Tensor, bool]:
    """a⁻¹b for a symmetric a [D, D] (float64): a Cholesky solve where a is positive definite,
    else the pseudo-inverse, logged (with `hint`); returns (solution, used the pseudo-inverse)."""
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(b, chol), False
    log.warning("%s: the matrix is not positive definite (Cholesky failed at column %d); "
                "solved with the pseudo-inverse%s", what, int(info), hint)
    return torch.linalg.pinv(a, hermitian=True) @ b, True


def normalise_classes(w: torch.Tensor, bias: torch.Tensor, present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each class's weight w_c [C, D] (and its bias) divided by ||w_c|| (Erosinho13/Fed3R
    ``normalize_W``; FedCOF's ``normalize``); absent or zero classes stay zero."""
    norm = w.norm(dim=-1)
    ok = present & (norm > 0)
    denom = torch.where(ok, norm, torch.ones_like(norm))
    return (torch.where(ok.unsqueeze(-1), w / denom.unsqueeze(-1), torch.zeros_like(w)),
            torch.where(ok, bias / denom, torch.zeros_like(bias)))


def linear_head(weight: torch.Tensor, bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"cls.weight": [D, C], "cls.bias": [C]} float32, the core's layout of a linear head."""
    return {"cls.weight": weight.to(torch.float32).T.contiguous(), "cls.bias": bias.to(torch.float32).contiguous()}


class Fed3R(AlgorithmBase):
    """Fed3R in the core's algorithm protocol (one pass, no training)."""

    name = "fed3r"
    description = "Fed3R (Fanì et al. 2024): closed-form ridge-regression classifier from summed Gram matrices"
    config = Fed3RConfig
    global_rule = "main"
    one_pass = True  # each client sends its statistics once
    seed_free = True  # a deterministic function of the statistics
    sums_messages = True  # the server reads only the summed Grams, class sums and counts
    clamp_noisy_counts = False  # presence is decided on the running total of the noisy counts

    def __init__(self, cfg: Fed3RConfig = Fed3RConfig()) -> None:
        if cfg.dtype not in DTYPES:
            raise UserError(f"dtype={cfg.dtype!r}: must be one of {', '.join(DTYPES)}")
        if not cfg.lam >= 0:
            raise UserError(f"lam={cfg.lam!r}: the ridge penalty must be >= 0")
        if not (cfg.lam_noise_scale >= 0 and math.isfinite(cfg.lam_noise_scale)):
            raise UserError(f"lam_noise_scale={cfg.lam_noise_scale!r}: must be a number >= 0")
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]

    def init(self, spec: DataSpec, seed: int) -> Init:
        C, D, dev = spec.num_classes, spec.dim, spec.device
        Dp = D + int(self.cfg.bias)
        def z(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        ss = Fed3RServerState(z(Dp, Dp), z(C, D), z(C, dtype=torch.int64), z(C, D), z(C), z(C, dtype=torch.bool),
                              z(dtype=torch.bool))
        return Init(Fed3RClientState(torch.zeros(spec.num_clients, dtype=torch.bool, device=dev)), ss, Fed3RBroadcast())

    def client_update(self, cs: Fed3RClientState, bc: Fed3RBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[Fed3RClientState, Fed3RMessage]:
        sums, counts = client_stats(data.x_train, data.y_train, data.m_train, data.num_classes)
        gram = client_gram(data.x_train, data.m_train)
        if self.cfg.bias:  # A_k = [x, 1]^T [x, 1] (fed3r_step)
            gram = with_bias_column(gram, sums, counts)
        fresh = ~cs.sent.to(sums.device)  # a client contributes exactly once
        f = fresh.to(torch.float64)
        msg = Fed3RMessage((gram * f.view(-1, 1, 1)).to(self.dtype), (sums * f.view(-1, 1, 1)).to(self.dtype),
                           counts * fresh.view(-1, 1).to(counts.dtype))
        return Fed3RClientState(torch.ones_like(cs.sent)), msg

    def summed_update(self, cs: Fed3RClientState, bc: Fed3RBroadcast, data: FedData,
                      ctx: RoundCtx) -> tuple[Fed3RClientState, Fed3RMessage]:
        """sum_k A_k and sum_k b_k of the clients in `data` (those that have not sent yet) as one
        row: one Gram of their rows pooled instead of one per client."""
        M, N, D = data.x_train.shape
        rows = (data.m_train & ~cs.sent.to(data.m_train.device).view(-1, 1)).reshape(1, M * N)
        x, y = data.x_train.reshape(1, M * N, D), data.y_train.reshape(1, M * N)
        sums, counts = client_stats(x, y, rows, data.num_classes)
        gram = client_gram(x, rows)
        if self.cfg.bias:
            gram = with_bias_column(gram, sums, counts)
        return Fed3RClientState(torch.ones_like(cs.sent)), Fed3RMessage(gram.to(self.dtype), sums.to(self.dtype), counts)

    def server_aggregate(self, ss: Fed3RServerState, msg: Fed3RMessage,
                         ctx: RoundCtx) -> tuple[Fed3RServerState, Fed3RBroadcast]:
        gram = ss.gram + msg.gram.to(torch.float64).sum(0)  # sums of client contributions ...
        sums = ss.sums + msg.sums.to(torch.float64).sum(0)
        counts = ss.counts + msg.counts.sum(0)
        sigma = float((ctx.noise_std or {}).get("gram", 0.0))  # under DP: the noise std of each round's Gram total
        weight, bias, present, pinv = self.finalize(gram, sums, counts, ctx.round + 1, sigma)  # ... then finalize
        return Fed3RServerState(gram, sums, counts, weight, bias, present, pinv), Fed3RBroadcast()

    def lam(self, dim: int, rounds: int = 1, gram_noise_std: float = 0.0) -> float:
        """λ: ``lam``, plus under DP κ σ √(R D') for a Gram summed over R rounds' noisy totals, each
        of noise std σ = `gram_noise_std` per entry (independent draws: σ √R after R rounds)."""
        return float(self.cfg.lam) + float(self.cfg.lam_noise_scale) * float(gram_noise_std) * math.sqrt(rounds * dim)

    def finalize(self, gram: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, rounds: int = 1,
                 gram_noise_std: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight [C, D], bias [C], present [C], used pinv []) of the summed statistics:
        solve(λI + ΣA_k, Σb_k) (calc_ridge_params), then each class normalised (normalize_W); λ = `lam`'s
        for R = `rounds` rounds of Gram totals of noise std `gram_noise_std` (0: exact totals)."""
        present = counts > 0
        b = sums.T  # [D, C]: b's feature rows
        if self.cfg.bias:
            b = torch.cat([b, counts.to(torch.float64).unsqueeze(0)], 0)  # b's bias row: onehot(y) summed
        lam = self.lam(gram.shape[0], rounds, gram_noise_std)
        a = gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        hint = f" (lam={lam:g}; lam > 0 makes it definite, under DP lam_noise_scale >= 2)"
        sol, pinv = solve_psd(a, b, "fed3r: lambda I + sum_k A_k", hint)
        D = sums.shape[1]
        bias = sol[D] if self.cfg.bias else torch.zeros_like(sol[0])
        weight, bias = normalise_classes(sol[:D].T, bias, present)
        return weight, bias, present, torch.tensor(pinv, device=gram.device)

    def predict(self, cs: Fed3RClientState, ss: Fed3RServerState, x: torch.Tensor,
                mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if not bool(ss.present.any()):
            if not bool(ss.gram.any()):
                raise UserError("fed3r: no statistics yet (run at least one round)")
            raise UserError("fed3r: no class has a count >= 1, so the head predicts nothing (under DP the counts are "
                            "noisy: the noise swamps them at this privacy level; raise the epsilon)")
        return {"main": class_scores(ss.weight, ss.bias, ss.present, x)}

    def linear_head(self, ss: Fed3RServerState) -> dict[str, torch.Tensor]:
        """The ridge classifier itself as the fine-tuning head (Fed3R+FT: W and its bias)."""
        return linear_head(ss.weight, ss.bias)

    def prototype_view(self, cs: Fed3RClientState, ss: Fed3RServerState, x: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
        """Inner products of [x, 1] with [w_c, bias_c] (faiss batch prediction)."""
        M = x.shape[0]
        dt = torch.promote_types(x.dtype, ss.weight.dtype)
        q = torch.cat([x.to(dt), torch.ones(*x.shape[:-1], 1, dtype=dt, device=x.device)], -1)
        p = torch.cat([ss.weight.to(dt), ss.bias.to(dt).unsqueeze(-1)], -1)
        return q, p.unsqueeze(0).expand(M, -1, -1), ss.present.unsqueeze(0).expand(M, -1), "ip"

    def secure_form(self, message: object = None) -> SecureForm:
        """Under SecAgg+ the server sees only Σ_k A_k, the summed class sums and counts."""

        def agg(ss: Fed3RServerState, clear: object, tot: dict[str, torch.Tensor], ctx: RoundCtx) -> tuple:
            g = tot["gram"]
            g = 0.5 * (g + g.T)  # symmetric part (post-processing: a noisy sum is not symmetric)
            one = Fed3RMessage(g[None], tot["sums"][None], tot["counts"].round().to(torch.int64)[None])
            return self.server_aggregate(ss, one, ctx)

        return SecureForm(lambda m: {"gram": m.gram[0].double(), "sums": m.sums[0].double(),
                                     "counts": m.counts[0].double()}, ("counts",), lambda m: None, agg)

    def dp_sensitivity(self, clip: float) -> dict[str, float]:
        """One example, its feature clipped to L2 norm `clip`, moves A by φ̃φ̃ᵀ (Frobenius norm
        ||φ̃||² = clip² + 1 with the bias column), one class sum by `clip` and one count by 1."""
        return {"gram": float(clip) ** 2 + float(self.cfg.bias), "sums": float(clip), "counts": 1.0}

    def dp_finalize(self, noise_std: dict[str, float], spec: DataSpec) -> dict[str, Any]:
        """The solve's λ = lam + lam_noise_scale · σ_gram · √(R D') (module docstring; σ_gram reaches
        `finalize` in RoundCtx.noise_std): the rule and its one-round value, for results.json."""
        Dp = spec.dim + int(self.cfg.bias)
        sigma = float(noise_std.get("gram", 0.0))
        return {"fed3r_lam": self.lam(Dp, 1, sigma),
                "fed3r_lam_rule": "lam + lam_noise_scale * gram_noise_std * sqrt(R * D'), "
                "R = the rounds whose noisy totals the Gram sums (fed3r_lam: R = 1)",
                "lam": self.cfg.lam, "lam_noise_scale": self.cfg.lam_noise_scale, "gram_noise_std": sigma,
                "gram_dim": Dp, "gram_noise": "iid per entry, symmetrised: (G + G^T) / 2"}

    def paper_round_comm(self, arch: HeadArch, clients: int) -> PaperRoundComm:
        """Up: A_k (D'²) and b_k (D'·C), D' = D + 1 with the bias column; down: the classifier
        (D'·C), counted as FedNCM's Appendix A counts its head."""
        Dp = arch.in_dim + int(self.cfg.bias)
        return PaperRoundComm(Dp * Dp + Dp * arch.num_classes, Dp * arch.num_classes)

    def trainable_params(self, cs: Fed3RClientState) -> int:
        return 0  # nothing is trained: the classifier is computed in closed form


def _factory(**kw: object) -> Fed3R:
    return Fed3R(Fed3RConfig(**kw))  # type: ignore[arg-type]


from fedheads.algorithms import register_algorithm  # noqa: E402

register_algorithm("fed3r", _factory, description=Fed3R.description, config=Fed3R.config)
