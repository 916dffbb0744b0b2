"""FedDRA's uncertainty-set projections (fedheads.alignment.dro) against a generic solver (scipy SLSQP)
on random cases, plus the edge cases and the saturation values worked out in the FedDRA notes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize

from embedcache.errors import UserError
from fedheads.alignment import dro

CASES = 120


def _kl(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum(a * (np.log(np.maximum(a, 1e-300)) - np.log(b))))


def _slsqp(obj, cons, n: int, x0: np.ndarray) -> np.ndarray:
    res = minimize(obj, x0, method="SLSQP", bounds=[(1e-12, 1.0)] * n,
                   constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1.0}, {"type": "ineq", "fun": cons}],
                   options={"ftol": 1e-15, "maxiter": 2000})
    return res.x


def _random_step(rng: np.random.Generator) -> tuple[np.ndarray, float]:
    n = int(rng.integers(2, 11))
    lam = rng.dirichlet(np.full(n, 2.0))
    v = rng.uniform(0, 5, n) * rng.choice([0.3, 1.0, 3.0])
    return dro.mirror_step(lam, v, 1.0), float(10 ** rng.uniform(-3, 1))


def test_kl_projection_matches_slsqp():
    rng = np.random.default_rng(0)
    active = 0
    for _ in range(CASES):
        lt, rho = _random_step(rng)
        n = lt.size
        r = dro.radius(dro.DROConfig(rho=rho), n)
        ours = dro.project_kl(lt, r)
        assert ours.min() >= 0 and abs(ours.sum() - 1) < 1e-12
        assert dro.kl_to_uniform(ours) <= r + 1e-12  # feasible
        ref = _slsqp(lambda x, lt=lt: _kl(x, lt), lambda x, r=r: r - dro.kl_to_uniform(x), n, dro.uniform(n))
        assert dro.kl_to_uniform(ref) <= r + 1e-7
        assert _kl(ours, lt) <= _kl(ref, lt) + 1e-6  # never worse than the generic solver
        assert abs(_kl(ours, lt) - _kl(ref, lt)) <= 1e-6
        active += dro.kl_to_uniform(lt) > r
    assert active > CASES // 3  # most cases exercise the bisection, not the "inside" shortcut


@pytest.mark.parametrize("in_simplex", [True, False])
def test_chi2_projection_matches_slsqp(in_simplex):
    rng = np.random.default_rng(1 + in_simplex)
    active = 0
    for _ in range(CASES):
        if in_simplex:
            lt, rho = _random_step(rng)
        else:  # the general case: any point of R^N (sort-based simplex projection + bisection)
            n = int(rng.integers(2, 11))
            lt, rho = rng.normal(1.0 / n, rng.choice([0.1, 0.5, 2.0]), n), float(10 ** rng.uniform(-3, 1))
        n = lt.size
        u = dro.uniform(n)
        R = dro.radius(dro.DROConfig(rho=rho, divergence="chi2"), n)
        ours = dro.project_chi2(lt, R)
        assert ours.min() >= 0 and abs(ours.sum() - 1) < 1e-12
        assert np.linalg.norm(ours - u) <= R + 1e-12
        ref = _slsqp(lambda x, lt=lt: float(np.sum((x - lt) ** 2)), lambda x, R=R, u=u: R ** 2 - float(np.sum((x - u) ** 2)),
                     n, u)
        obj = float(np.sum((ours - lt) ** 2))
        ref_obj = float(np.sum((ref - lt) ** 2))
        assert obj <= ref_obj + 1e-6 and abs(obj - ref_obj) <= 1e-6
        active += np.linalg.norm(dro.project_simplex(lt) - u) > R
    assert active > CASES // 3


def test_simplex_projection_matches_slsqp():
    rng = np.random.default_rng(3)
    for _ in range(CASES):
        n = int(rng.integers(2, 11))
        y = rng.normal(0, 1, n)
        ours = dro.project_simplex(y)
        ref = _slsqp(lambda x, y=y: float(np.sum((x - y) ** 2)), lambda x: 1.0, n, dro.uniform(n))
        assert abs(ours.sum() - 1) < 1e-12 and ours.min() >= 0
        assert np.sum((ours - y) ** 2) <= np.sum((ref - y) ** 2) + 1e-6


def test_radius_conventions():
    n = 5
    assert dro.radius(dro.DROConfig(rho=0.5), n) == pytest.approx(0.1)
    assert dro.radius(dro.DROConfig(rho=0.5, radius_convention="rho"), n) == pytest.approx(0.5)
    assert dro.radius(dro.DROConfig(rho=0.5, divergence="chi2"), n) == pytest.approx(math.sqrt(0.5) / n)
    assert dro.radius(dro.DROConfig(rho=0.5, divergence="chi2", chi2_f="(t-1)^2/2"), n) == pytest.approx(
        math.sqrt(1.0) / n)
    # the literal Eq. 2: sum_i f(N lambda_i) <= rho  <=>  ||lambda - u|| <= sqrt(rho)/N for f = (t-1)^2
    lam = dro.project_chi2(np.array([0.9, 0.05, 0.02, 0.02, 0.01]), dro.radius(dro.DROConfig(rho=0.5, divergence="chi2"), n))
    assert np.sum((n * lam - 1) ** 2) == pytest.approx(0.5)
    lam = dro.project_kl(np.array([0.9, 0.05, 0.02, 0.02, 0.01]), dro.radius(dro.DROConfig(rho=0.5), n))
    assert np.sum(n * lam * np.log(n * lam)) == pytest.approx(0.5, abs=1e-9)


def test_edge_cases():
    lt = np.array([0.5, 0.3, 0.2])
    assert np.array_equal(dro.project_kl(lt, 0.0), dro.uniform(3))
    assert np.array_equal(dro.project_chi2(lt, 0.0), dro.uniform(3))
    # inside the ball: returned unchanged
    assert np.array_equal(dro.project_kl(lt, dro.kl_to_uniform(lt) + 1e-3), lt)
    assert np.array_equal(dro.project_chi2(lt, 1.0), lt)
    # rho = 0: uniform whatever the losses, and a learning-rate scale of exactly 1 (FedAvg)
    cfg = dro.DROConfig(rho=0.0)
    for n in range(1, 60):
        lam = dro.update(dro.uniform(n), np.arange(n, dtype=float), cfg)
        assert np.all(dro.step_scale(lam) == 1.0)
    # equal losses leave lambda where it is; a huge loss cannot overflow the mirror step
    lam = np.array([0.2, 0.3, 0.5])
    np.testing.assert_allclose(dro.mirror_step(lam, np.full(3, 7.0), 1.0), lam, rtol=1e-14)
    assert np.isfinite(dro.update(lam, np.array([1e4, 0.0, 0.0]), dro.DROConfig(rho=1.0))).all()
    with pytest.raises(UserError, match="rho -1"):
        dro.DROConfig(rho=-1)
    with pytest.raises(UserError, match="divergence"):
        dro.DROConfig(divergence="tv")
    with pytest.raises(UserError, match="finite"):
        dro.update(lam, np.array([np.nan, 0, 0]), dro.DROConfig())


@pytest.mark.parametrize("n,rho,div,want", [(5, 0.1, "kl", 0.284), (5, 0.1, "chi2", 0.257),
                                            (5, 1.0, "kl", 0.483), (5, 1.0, "chi2", 0.379),
                                            (2, 0.5, "kl", 0.838), (2, 0.5, "chi2", 0.750)])
def test_always_worst_client_saturates_at_the_ball(n, rho, div, want):
    """FedDRA notes ("Uncertainty set"): an always-worst client's weight saturates at the boundary."""
    cfg = dro.DROConfig(rho=rho, divergence=div)
    lam = dro.uniform(n)
    v = np.zeros(n)
    v[0] = 1.0
    for _ in range(500):
        lam = dro.update(lam, v, cfg)
    assert round(float(lam[0]), 3) == want
    # the boundary by hand: the largest a with D_f((a, (1-a)/(n-1), ...) || u) = radius
    b = (1 - lam[0]) / (n - 1)
    if div == "kl":
        assert lam[0] * math.log(n * lam[0]) + (n - 1) * b * math.log(n * b) == pytest.approx(rho / n, abs=1e-9)
    else:
        assert (lam[0] - 1 / n) ** 2 + (n - 1) * (b - 1 / n) ** 2 == pytest.approx(rho / n ** 2, abs=1e-12)
