"""FedDRA's client weights: mirror ascent on lambda and exact projections onto the uncertainty set.

FedDRA ("Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training
Under Data Heterogeneity", under review at TMLR), Sec. 4.3, Eq. 2 and Alg. 1 lines 13-19:

    sup_lambda in Delta  sum_i lambda_i R_i(theta)   s.t.  D_f(N lambda || 1) <= rho        (Eq. 2)
    lambda~ = lambda^r * exp(gamma v) / sum_j lambda_j^r exp(gamma v_j)                     (Alg. 1 l. 18)
    lambda^{r+1} = Proj_Q(lambda~)

The paper names neither f nor the projection's metric; the reading (FedDRA notes, "DRO") is:
- Radius: D_f(N lambda || 1) = sum_i f(N lambda_i) = N D_f(lambda || u), so the paper's ball is
  D_f(lambda || u) <= rho / N, the Namkoong-Duchi (NeurIPS 2016) convention ("rho/N", default);
  "rho" takes D_f(lambda || u) <= rho instead.
- f = KL (default): projection in KL, the natural pair of mirror ascent: min KL(lambda || lambda~)
  s.t. KL(lambda || u) <= r. KKT: lambda(beta) = softmax(beta log lambda~), beta in [0, 1], and
  KL(lambda(beta) || u) rises with beta: keep lambda~ when inside, else bisect beta.
- f = chi2: f(t) = (t - 1)^2 (default) or (t - 1)^2 / 2; the ball is ||lambda - u||_2 <= R with
  R = sqrt(rho)/N (resp. sqrt(2 rho)/N) under "rho/N". Euclidean projection:
  for a general point, lambda(s) = P_simplex(u + s (lambda~ - u)) with the largest feasible
  s in [0, 1] (the Lagrangian of the ball constraint, s = 1/(1 + nu)); for lambda~ already in the
  simplex this is the closed form u + min(1, R / ||lambda~ - u||) (lambda~ - u).
Everything runs in float64 numpy (N is the number of clients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from embedcache.errors import UserError
from fedheads.core.config import setting

DIVERGENCES = ("kl", "chi2")
RADIUS_CONVENTIONS = ("rho/N", "rho")
CHI2_F = ("(t-1)^2", "(t-1)^2/2")
_BISECT = 200  # halvings of [0, 1]: far below float64 resolution


@dataclass(frozen=True)
class DROConfig:
    """The uncertainty set and the mirror step (sources in the module docstring)."""

    rho: float = setting(0.1, "radius (FedDRA App. A.1: 0.1 on MIMIC-CXR; 0.5 ophthalmology); 0 = uniform weights (FedAvg)",
                         source="FedDRA App. A.1")
    divergence: str = setting("kl", "f of Eq. 2 (not named by the paper; notes [R]: KL, chi2 as option)", source="FedDRA Eq. 2")
    radius_convention: str = setting("rho/N", 'D_f(lambda||u) <= rho/N (Namkoong-Duchi, = Eq. 2 literally) | "rho"',
                                     source="FedDRA Eq. 2")
    chi2_f: str = setting("(t-1)^2", "chi2 generator: (t-1)^2 -> R = sqrt(rho)/N, or (t-1)^2/2 -> sqrt(2 rho)/N")
    gamma: float = setting(1.0, "mirror step size of Alg. 1 line 18 (not given; notes [R]: 1)", source="FedDRA Alg. 1")

    def __post_init__(self) -> None:
        if not (self.rho >= 0 and math.isfinite(self.rho)):
            raise UserError(f"rho {self.rho}: must be a finite number >= 0")
        if self.divergence not in DIVERGENCES:
            raise UserError(f"divergence {self.divergence!r}: use one of {', '.join(DIVERGENCES)}")
        if self.radius_convention not in RADIUS_CONVENTIONS:
            raise UserError(f"radius_convention {self.radius_convention!r}: use one of {', '.join(RADIUS_CONVENTIONS)}")
        if self.chi2_f not in CHI2_F:
            raise UserError(f"chi2_f {self.chi2_f!r}: use one of {', '.join(CHI2_F)}")
        if not (self.gamma >= 0 and math.isfinite(self.gamma)):
            raise UserError(f"gamma {self.gamma}: must be a finite number >= 0")


def uniform(n: int) -> np.ndarray:
    """lambda^0 = 1/N (Alg. 1 input)."""
    return np.full(n, 1.0 / n, dtype=np.float64)


def kl_to_uniform(lam: np.ndarray) -> float:
    """KL(lambda || u) = log N + sum_i lambda_i log lambda_i (0 log 0 = 0)."""
    lam = np.asarray(lam, dtype=np.float64)
    pos = lam > 0
    return float(math.log(lam.size) + np.sum(lam[pos] * np.log(lam[pos])))


def radius(cfg: DROConfig, n: int) -> float:
    """The bound r on D_f(lambda || u) (KL) or R on ||lambda - u||_2 (chi2)."""
    r = cfg.rho / n if cfg.radius_convention == "rho/N" else cfg.rho
    if cfg.divergence == "kl":
        return r
    # D_f(lambda||u) = sum_i u_i f(N lambda_i) = c N ||lambda - u||^2 with c = 1 or 1/2
    c = 1.0 if cfg.chi2_f == "(t-1)^2" else 0.5
    return math.sqrt(r / (c * n))


def project_kl(lam_t: np.ndarray, r: float) -> np.ndarray:
    """argmin KL(lambda || lam_t) over the simplex s.t. KL(lambda || u) <= r (lam_t > 0 in the simplex)."""
    lam_t = np.asarray(lam_t, dtype=np.float64)
    n = lam_t.size
    if r <= 0:
        return uniform(n)
    if kl_to_uniform(lam_t) <= r:
        return lam_t.copy()
    logs = np.log(np.maximum(lam_t, np.finfo(np.float64).tiny))

    def at(beta: float) -> np.ndarray:
        z = beta * logs
        z = np.exp(z - z.max())
        return z / z.sum()

    lo, hi = 0.0, 1.0  # KL(lambda(lo)||u) <= r < KL(lambda(hi)||u)
    for _ in range(_BISECT):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if kl_to_uniform(at(mid)) <= r:
            lo = mid
        else:
            hi = mid
    return at(lo) if lo > 0 else uniform(n)


def project_simplex(y: np.ndarray) -> np.ndarray:
    """Euclidean projection onto the probability simplex, sort-based (Held, Wolfe & Crowder 1974;
    Duchi et al., ICML 2008, Fig. 1)."""
    y = np.asarray(y, dtype=np.float64)
    s = np.sort(y)[::-1]
    css = np.cumsum(s) - 1.0
    k = np.arange(1, y.size + 1)
    rho = np.nonzero(s - css / k > 0)[0][-1]
    theta = css[rho] / (rho + 1.0)
    return np.maximum(y - theta, 0.0)


def project_chi2(lam_t: np.ndarray, R: float) -> np.ndarray:
    """argmin ||lambda - lam_t||_2 over the simplex s.t. ||lambda - u||_2 <= R (any lam_t in R^N)."""
    lam_t = np.asarray(lam_t, dtype=np.float64)
    n = lam_t.size
    u = uniform(n)
    if R <= 0:
        return u
    if abs(lam_t.sum() - 1.0) <= 1e-12 and lam_t.min() >= 0:  # in the simplex: radial closed form
        dist = float(np.linalg.norm(lam_t - u))
        return lam_t.copy() if dist <= R else u + (R / dist) * (lam_t - u)
    d = lam_t - u

    def at(s: float) -> np.ndarray:
        return project_simplex(u + s * d)

    if np.linalg.norm(at(1.0) - u) <= R:
        return at(1.0)
    lo, hi = 0.0, 1.0  # ||lambda(s) - u|| is non-decreasing in s
    for _ in range(_BISECT):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if np.linalg.norm(at(mid) - u) <= R:
            lo = mid
        else:
            hi = mid
    return at(lo)


def mirror_step(lam: np.ndarray, v: np.ndarray, gamma: float) -> np.ndarray:
    """lambda * exp(gamma v) / sum (Alg. 1 line 18), in log space so large losses cannot overflow."""
    z = np.log(np.maximum(np.asarray(lam, dtype=np.float64), np.finfo(np.float64).tiny)) + \
        gamma * np.asarray(v, dtype=np.float64)
    z = np.exp(z - z.max())
    return z / z.sum()


def update(lam: np.ndarray, v: np.ndarray, cfg: DROConfig) -> np.ndarray:
    """lambda^{r+1} = Proj_Q(mirror step) (Eq. 2, Alg. 1 lines 17-19)."""
    lam = np.asarray(lam, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if lam.shape != v.shape or not np.isfinite(v).all():
        raise UserError(f"client losses v: expected {lam.size} finite values, got {v.tolist()}")
    if cfg.rho == 0:
        return uniform(lam.size)  # the ball is the point u: exactly FedAvg's weights
    step = mirror_step(lam, v, cfg.gamma)
    r = radius(cfg, lam.size)
    return project_kl(step, r) if cfg.divergence == "kl" else project_chi2(step, r)


def step_scale(lam: np.ndarray, mode: str = "n_lambda") -> np.ndarray:
    """Per-client multiplier of the learning rate (FedDRA Sec. 4.3: theta_i -= eta lambda_i grad).
    "n_lambda" (notes [R], default): s_i = N lambda_i = lambda_i / u_i, exactly 1 at uniform
    weights, so rho = 0 is FedAvg; "lambda": the literal lambda_i."""
    lam = np.asarray(lam, dtype=np.float64)
    if mode == "n_lambda":
        return lam / uniform(lam.size)  # a division by the same float 1/N: exactly 1.0 at u
    if mode == "lambda":
        return lam.copy()
    raise UserError(f"step scaling {mode!r}: use n_lambda or lambda")
