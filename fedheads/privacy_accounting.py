"""The accounting of fedheads.privacy's Gaussian mechanism: its parameters (`Mechanism`, the
`--dp-*` options), how the noise multiplier is divided between the statistics, the epsilon spent,
and the multiplier that spends a target epsilon (Google's `dp-accounting`, imported when called:
this module needs no torch). The mechanism itself (clipping, the noise, the wrapper) is
fedheads.privacy.

Budget between the statistics (sums and counts; Grams for Fed3R): one joint Gaussian mechanism
on the concatenation of the fields, each field divided by its own noise scale. With a split
w_f > 0, sum_f w_f = 1 (default: equal over the fields a single example can change),

    sigma_f = z * Delta_f / sqrt(w_f),

so one example moves the concatenated vector (s_f / sigma_f)_f by at most
sqrt(sum_f (Delta_f / sigma_f)^2) = sqrt(sum_f w_f) / z = 1 / z: the round is ONE Gaussian
mechanism of noise multiplier z (sensitivity 1, std z). It plays the role of pfl-research's
`JointMechanism` (one mechanism per group of statistics, the budget divided between them), but
divides the budget in the Gaussian's own (mu-GDP / zCDP) currency, where composing Gaussians is
exact, instead of dividing (epsilon, delta) between separately accounted mechanisms.

Accounting: a release is one round's noisy totals. Adjacency is adding or removing one example
(dp-accounting's ADD_OR_REMOVE_ONE). An example is in the releases of the rounds in which its
client sent non-zero statistics, r of them; the epsilon spent for delta is that of
``SelfComposedDpEvent(GaussianDpEvent(z), r)`` under the RDP (Mironov, "Renyi Differential
Privacy", 2017) or PLD (Doroshenko et al., "Connect the Dots: Tighter Discrete Approximations of
Privacy Loss Distributions", PETS 2022) accountant. A one-shot head (FedNCM, Alg. 1) sends each
client's statistics once, also under partial participation (a client that has sent sends zeros
afterwards), so r = 1: the run is one Gaussian mechanism, however many rounds it takes. Every
round still adds fresh noise to its own totals, so R rounds leave R noise draws in the final
sums; a round whose messages hold no secure sums at all (CCVR calibrating a saved head once
every client's statistics are in) releases nothing and draws none. r is counted per client
during the run (the client state) and the maximum is reported.
Several seeds trained on the same data are several releases of it: results.json also gives the
epsilon of publishing every seed's head.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from embedcache.errors import UserError
from fedheads.core.config import setting

MODES = ("central", "distributed", "local")
TRANSFORMS = ("clip", "normalize")
ACCOUNTANTS = ("rdp", "pld")
MIN_NOISE = 0.02  # a Gaussian mechanism below this noise multiplier spends epsilon above about 1,000
MAX_EPSILON = 1e3  # a budget above it protects nothing: refused as --dp-epsilon, said of a --dp-noise-multiplier
MAX_CLIP = 1e100  # its square (a second moment's sensitivity) stays a finite float64


@dataclass(frozen=True)
class Mechanism:
    """A Gaussian mechanism on an algorithm's secure sums (local mode: on each client's own
    statistics): the `--dp-*` options. Give `noise_multiplier` or `epsilon`."""

    clip: float = setting(1.0, "L2 bound C of each training feature")
    transform: str = setting("clip", "scale each feature to norm <= C (clip) or exactly C (normalize)",
                             choices=TRANSFORMS)
    noise_multiplier: float | None = setting(None, "or: the Gaussian noise multiplier z itself (epsilon is then "
                                             "reported)")
    epsilon: float | None = setting(None, "train under differential privacy, calibrated to spend at most this epsilon "
                                    "(algorithms with a DP form: fedncm, fed3r, ccvr calibrating a saved head; "
                                    "fedpft with --dp-mode local)")
    delta: float = setting(1e-5, "the delta epsilon is reported for (and calibrated to)")
    mode: str = setting("central", "noise added once by the server (central), or split over the clients under SecAgg+ "
                        "(distributed), or by each client on its own statistics (local: fedpft)", choices=MODES)
    accountant: str = setting("rdp", "dp-accounting's accountant", choices=ACCOUNTANTS)
    releases: int = setting(1, "releases of each client's statistics the calibration plans for (one-shot heads: 1)",
                            cli=False)
    split: tuple[tuple[str, float], ...] = setting((), "budget split over the noised sums, e.g. sums=0.9,counts=0.1 "
                                                   "(default: equal)", metavar="FIELD=W,...")
    noise_seed: int | None = setting(None, "reproducible noise (simulation only; default: a secret key from the OS)")

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise UserError(f"--dp-clip {self.clip}: must be a positive number")
        if self.clip > MAX_CLIP:
            raise UserError(f"--dp-clip {self.clip:g}: above {MAX_CLIP:g}, where the sensitivity of a second moment "
                            "(the clip squared) is no longer a finite number; scale the features instead")
        for name, v, ok in (("--dp-transform", self.transform, TRANSFORMS), ("--dp-mode", self.mode, MODES),
                            ("--dp-accountant", self.accountant, ACCOUNTANTS)):
            if v not in ok:
                raise UserError(f"{name} {v!r}: must be one of {', '.join(ok)}")
        if (self.noise_multiplier is None) == (self.epsilon is None):
            raise UserError("dp: give exactly one of --dp-epsilon and --dp-noise-multiplier")
        if self.noise_multiplier is not None and not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise UserError(f"--dp-noise-multiplier {self.noise_multiplier}: must be a positive number")
        if self.epsilon is not None and not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise UserError(f"--dp-epsilon {self.epsilon}: must be a positive number")
        if self.epsilon is not None and self.epsilon > MAX_EPSILON:
            raise UserError(f"--dp-epsilon {self.epsilon:g}: above {MAX_EPSILON:g}, a budget that protects nothing "
                            "(train without DP, or give --dp-noise-multiplier)")
        if not 0 < self.delta < 1:
            raise UserError(f"--dp-delta {self.delta}: must be in (0, 1)")
        if self.releases < 1:
            raise UserError(f"dp releases {self.releases}: must be >= 1")
        for k, w in self.split:
            if not (math.isfinite(w) and w > 0):
                raise UserError(f"--dp-split {k}={w}: weights must be positive numbers")

    def z(self) -> float:
        """The noise multiplier: as given, or calibrated to `epsilon` for `releases` releases."""
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        assert self.epsilon is not None
        return calibrate(self.epsilon, self.delta, self.releases, self.accountant)


def pld_interval(z: float, releases: int) -> float:
    """PLD's value discretisation: 1e-3 (dp-accounting's default 1e-4 is ten times slower and moves
    epsilon by < 1e-6 here), coarser where the privacy loss range, about
    releases / (2 z^2) + 10 sqrt(releases) / z, would need more than 1e5 buckets. A coarser grid
    still bounds epsilon from above (Doroshenko et al., Sec. 3: pessimistic rounding)."""
    return max(1e-3, (releases / (2.0 * z * z) + 10.0 * math.sqrt(releases) / z) * 1e-5)


def _accountant(kind: str, z: float, releases: int) -> Any:
    import dp_accounting

    if kind == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    return dp_accounting.pld.PLDAccountant(value_discretization_interval=pld_interval(z, releases))


def dp_event(z: float, releases: int) -> Any:
    """`releases` Gaussian mechanisms of noise multiplier z on the same examples."""
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), int(releases))


def epsilon(z: float, delta: float, releases: int = 1, accountant: str = "rdp") -> float:
    """Epsilon spent at `delta` by `releases` Gaussian releases of noise multiplier z."""
    if releases == 0:
        return 0.0
    with quiet_numerics():
        acc = _accountant(accountant, z, releases)
        acc.compose(dp_event(z, releases))
        return float(acc.get_epsilon(delta))


@contextlib.contextmanager
def quiet_numerics() -> Iterator[None]:
    """dp-accounting's numpy warnings (overflow, log of 0 at the ends of its searches) kept off the
    console: its answers are checked, and a bad one refused in one line, here."""
    import numpy as np

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@functools.lru_cache(maxsize=64)
def calibrate(target: float, delta: float, releases: int = 1, accountant: str = "rdp") -> float:
    """The smallest noise multiplier (to dp-accounting's bisection tolerance) whose `releases`
    releases spend at most `target` epsilon at `delta` under `accountant`.

    Composed Gaussians are one Gaussian of multiplier z / sqrt(releases), whose exact epsilon is
    the analytic one (Balle & Wang, "Improving the Gaussian Mechanism for Differential Privacy",
    ICML 2018, Theorem 8): its z0 = sigma(target, delta) * sqrt(releases) is a lower bound of
    both accountants' answer (each bounds epsilon from above), so the search starts there."""
    import dp_accounting

    with quiet_numerics():
        z0 = dp_accounting.get_sigma_gaussian(target, delta) * math.sqrt(releases)
    if not math.isfinite(z0):
        raise UserError(f"--dp-epsilon {target}: no noise multiplier found for it at --dp-delta {delta}")
    if z0 < MIN_NOISE:
        raise UserError(f"--dp-epsilon {target}: so large that a noise multiplier below 0.02 would do "
                        "(train without DP, or give --dp-noise-multiplier)")
    if z0 > 1e4:
        raise UserError(f"--dp-epsilon {target}: too small for --dp-delta {delta} (needs a noise multiplier above 1e4)")
    lo, hi = z0 * (1 - 1e-3), z0 * 1.1
    while epsilon(hi, delta, releases, accountant) > target:
        lo, hi = hi, hi * 2
    with quiet_numerics():
        z = dp_accounting.calibrate_dp_mechanism(
            lambda: _accountant(accountant, lo, releases), lambda s: dp_event(s, releases), target, delta,
            dp_accounting.ExplicitBracketInterval(lo, hi), tol=1e-5 * z0)
    while epsilon(z, delta, releases, accountant) > target:  # the bracket's end on the private side
        z *= 1 + 1e-6
    return float(z)


def noise_stds(sensitivity: Mapping[str, float], z: float, split: Sequence[tuple[str, float]] = ()) -> dict[str, float]:
    """sigma_f = z * Delta_f / sqrt(w_f) per field (module docstring); a field no example can
    change (Delta_f = 0) gets no noise and no share of the budget."""
    moved = [k for k, d in sensitivity.items() if d > 0]
    weights = dict(split)
    unknown = sorted(set(weights) - set(moved))
    if unknown:
        raise UserError(f"--dp-split {unknown[0]}: not a noised field (fields: {', '.join(moved)})")
    if weights and set(weights) != set(moved):
        raise UserError(f"--dp-split: give a weight for every field ({', '.join(moved)})")
    top = max(weights.values()) if weights else 1.0
    weights = {k: v / top for k, v in weights.items()}  # scaled to <= 1 first: 1e308-sized weights still add up
    total = sum(weights.values()) if weights else float(len(moved))
    w = {k: (weights[k] / total if weights else 1.0 / total) for k in moved}
    if any(not v > 0 for v in w.values()):
        raise UserError("--dp-split: weights so far apart that a field's share is 0 (keep their ratio under 1e300)")
    return {k: (z * float(d) / math.sqrt(w[k]) if d > 0 else 0.0) for k, d in sensitivity.items()}


def privacy_lines(block: Mapping[str, Any] | None) -> list[str]:
    """What a run's `privacy` block (results.json) guarantees, for the console: the epsilon each
    seed's head spent and the seeds' heads together (they are releases of the same data), and
    where it protects nothing, that."""
    if not block:
        return []
    eps, both, delta = block.get("epsilon"), block.get("epsilon_all_seeds"), block.get("delta")
    shown = [f"privacy: ({_num(eps)}, {delta:g})-DP per seed's head ({block.get('accountant')}, noise multiplier "
             f"{block.get('noise_multiplier'):.4g}); all seeds' heads together: ({_num(both)}, {delta:g})-DP"]
    if block.get("guarantee"):
        shown.append(f"privacy: {block['guarantee']}")
    return shown


def _num(x: Any) -> str:
    return "inf" if x is None or not math.isfinite(float(x)) else f"{float(x):.3g}"
