"""Evaluation metrics in the papers' conventions.

* Accuracy is reported in percent, per client, then as "mean(std)" (FedPCL Tables 2-3:
  "82.75(0.40)"): the client average is taken within a seed, and mean and std are taken
  over seeds. The std over seeds is the SAMPLE std (``ddof=1``, ``STD_DDOF``): the FedPCL
  authors' script prints ``torch.std`` of the per-trial averages over its 3 trials, and
  torch.std is unbiased. (numpy's default ``ddof=0`` would give sqrt(2/3) = 0.816 x their
  figure over 3 seeds.) One seed has std 0. Every function takes ``ddof`` to change it.
* Fairness follows FedPCL Appendix A.2.2, Tables 12-13 (metrics of q-FFL, Li et al. ICLR
  2020 [81]): average, mean accuracy of the worst 10/20/40 % and best 10 % of clients, and
  the spread of the per-client accuracy distribution, each computed within ONE run, then
  mean (std) over seeds like the accuracy.

  Number of clients in a fraction q of n: k = max(1, floor(q * n)). floor is q-FFL's own
  rule (its fairness script takes ``int(num_clients * 0.1)`` clients); Tables 12-13 use 40
  and 80 clients, where every fraction is a whole number (4/8/16 and 8/16/32), so the paper
  shows no rounding. With fewer clients floor can reach 0 (q-FFL would average an empty
  slice); we take at least one client. 5 clients: worst 10 % = worst 20 % = 1 client, worst
  40 % = 2, best 10 % = 1; 4 clients: 1, 1, 1 and 1.

  Unit of "Variance": the per-client spread of one run is a property of those clients (the
  whole population, not a sample), so it uses ``ddof=0`` whatever the std over seeds uses.
  q-FFL's script reports ``np.var`` of accuracies x 10^4, a variance in pp^2; FedPCL's
  published values (8.45-13.20, for client accuracies of 12-66 %) cannot be that: Table 12's
  "Ours" row (average 48.39, worst 10 % 35.35, best 10 % 62.72) implies a spread of about
  8 pp, so the figures are a standard deviation in percentage points (a variance would be
  ~70). ``Fairness.variance`` is therefore the population std of the per-client accuracies
  in percentage points; the true variance (pp^2) is kept alongside as ``Fairness.var_pp2``
  so nothing is hidden behind the name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from embedcache.errors import UserError

FAIRNESS_KEYS = ("average", "worst_10", "worst_20", "worst_40", "best_10", "variance")
STD_DDOF = 1  # std over seeds: sample std, as torch.std in the FedPCL authors' code


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy in percent of one client's test set."""
    p = np.asarray(predictions).reshape(-1)
    y = np.asarray(labels).reshape(-1)
    if p.shape != y.shape:
        raise UserError(f"predictions {p.shape} vs labels {y.shape}: lengths differ")
    if y.size == 0:
        raise UserError("labels: empty test set, accuracy is undefined")
    return float(100.0 * np.mean(p == y))


def per_client_accuracy(
    predictions: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]
) -> dict[str, float]:
    """Accuracy in percent for every client (the same client names in both mappings)."""
    if set(predictions) != set(labels):
        missing = sorted(set(predictions) ^ set(labels))
        raise UserError(f"{missing[0]}: client present in only one of predictions/labels")
    return {c: accuracy(predictions[c], labels[c]) for c in sorted(labels)}


def mean_std(values: Iterable[float], ddof: int = STD_DDOF) -> tuple[float, float]:
    """(mean, std) of a sequence; std with ``ddof`` (sample std by default), 0.0 when there
    are no more values than ``ddof`` (one seed)."""
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0:
        raise UserError("values: empty, mean/std undefined")
    if not np.all(np.isfinite(v)):
        raise UserError("values: contain NaN or inf")
    std = float(np.std(v, ddof=ddof)) if v.size > ddof else 0.0
    return float(np.mean(v)), std


def std_convention(ddof: int = STD_DDOF) -> str:
    """One line for reports: how "mean(std)" cells and the fairness Variance are computed."""
    kind = {0: "population std (ddof=0)", 1: "sample std (ddof=1, torch.std as in the FedPCL authors' code)"}
    return (f"mean(std) over seeds, std = {kind.get(ddof, f'std with ddof={ddof}')}; "
            "fairness Variance = population std of one run's client accuracies (pp)")


def format_mean_std(mean: float, std: float, decimals: int = 2) -> str:
    """The papers' cell format, e.g. ``format_mean_std(82.75, 0.4) == "82.75(0.40)"``."""
    return f"{mean:.{decimals}f}({std:.{decimals}f})"


def worst_fraction_mean(accs: Sequence[float], q: float, best: bool = False) -> float:
    """Mean accuracy of the worst (or best) ``q`` fraction of clients, at least one client.

    The number of clients is ``max(1, floor(q * n))`` (40 clients, q=0.1 -> 4; 5 clients:
    q=0.1 or 0.2 -> 1, q=0.4 -> 2; 4 clients: q=0.4 -> 1); see the module docstring."""
    if not 0.0 < q <= 1.0:
        raise UserError(f"q={q}: must be in (0, 1]")
    a = np.sort(np.asarray(accs, dtype=np.float64))
    if a.size == 0:
        raise UserError("accuracies: no clients")
    k = max(1, int(math.floor(q * a.size + 1e-9)))
    sel = a[-k:] if best else a[:k]
    return float(np.mean(sel))


@dataclass(frozen=True)
class Fairness:
    """FedPCL Tables 12-13 for one run (one seed); all values in percent."""

    average: float  # mean per-client accuracy
    worst_10: float  # mean of the worst 10 % of clients
    worst_20: float  # mean of the worst 20 % of clients
    worst_40: float  # mean of the worst 40 % of clients
    best_10: float  # mean of the best 10 % of clients
    variance: float  # the paper's "Variance": population std (ddof=0) of client accuracies (pp)
    var_pp2: float  # the true variance of client accuracies (pp^2), for reference

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def fairness(accs: Sequence[float] | Mapping[str, float]) -> Fairness:
    """Fairness metrics of one run from per-client accuracies in percent."""
    vals = list(accs.values()) if isinstance(accs, Mapping) else list(accs)
    a = np.asarray(vals, dtype=np.float64)
    if a.size == 0:
        raise UserError("accuracies: no clients")
    return Fairness(
        average=float(a.mean()),
        worst_10=worst_fraction_mean(a, 0.1),
        worst_20=worst_fraction_mean(a, 0.2),
        worst_40=worst_fraction_mean(a, 0.4),
        best_10=worst_fraction_mean(a, 0.1, best=True),
        variance=float(a.std(ddof=0)),  # clients of one run are the population
        var_pp2=float(a.var(ddof=0)),
    )


def fairness_over_seeds(
    per_seed: Sequence[Mapping[str, float]], ddof: int = STD_DDOF
) -> dict[str, dict[str, float]]:
    """Fairness per seed, then {metric: {mean, std}} over seeds (Tables 12-13 cells)."""
    if not per_seed:
        raise UserError("per_seed: no seeds")
    runs = [fairness(s).as_dict() for s in per_seed]
    out = {}
    for key in runs[0]:
        m, s = mean_std((r[key] for r in runs), ddof=ddof)
        out[key] = {"mean": m, "std": s}
    return out


def summarise_accuracy(
    per_seed: Sequence[Mapping[str, float]], ddof: int = STD_DDOF
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Overall and per-client mean/std over seeds.

    Overall = client average within each seed, then mean/std over seeds (the "Avg" column of
    FedPCL Table 2, whose std is smaller than the per-client stds). Every seed must report
    the same clients."""
    if not per_seed:
        raise UserError("per_seed: no seeds")
    clients = sorted(per_seed[0])
    for i, s in enumerate(per_seed):
        if sorted(s) != clients:
            raise UserError(f"seed #{i}: clients {sorted(s)} differ from seed #0 {clients}")
    m, sd = mean_std((float(np.mean([s[c] for c in clients])) for s in per_seed), ddof)
    per_client = {}
    for c in clients:
        cm, cs = mean_std((s[c] for s in per_seed), ddof)
        per_client[c] = {"mean": cm, "std": cs}
    return {"mean": m, "std": sd}, per_client


def aggregate_history(
    per_seed_history: Sequence[Sequence[Mapping[str, float]]], ddof: int = STD_DDOF
) -> list[dict[str, float]]:
    """Per-round curves over seeds: [{round, accuracy, std}] for rounds every seed has.

    Each seed's history is a list of ``{"round": r, "accuracy": acc}`` (the client-average
    accuracy in percent after round r); rounds evaluated by only some seeds are dropped so
    every point averages the same seeds. Where every seed's row has ``clients_seen`` (distinct
    clients that have taken part so far), the point carries its mean over seeds."""
    if not per_seed_history:
        return []
    maps = []
    seen: list[dict[int, float]] = []
    for i, hist in enumerate(per_seed_history):
        d: dict[int, float] = {}
        c: dict[int, float] = {}
        for row in hist:
            if "round" not in row or "accuracy" not in row:
                raise UserError(f"history of seed #{i}: rows need 'round' and 'accuracy'")
            d[int(row["round"])] = float(row["accuracy"])
            if "clients_seen" in row:
                c[int(row["round"])] = float(row["clients_seen"])
        maps.append(d)
        seen.append(c)
    common = sorted(set.intersection(*(set(d) for d in maps)))
    out: list[dict[str, float]] = []
    for r in common:
        m, s = mean_std((d[r] for d in maps), ddof)
        out.append({"round": r, "accuracy": m, "std": s})
        if all(r in c for c in seen):
            out[-1]["clients_seen"] = sum(c[r] for c in seen) / len(seen)
    return out


def nanmean(values: Iterable[float] | None) -> float:
    """The mean of the values that are not NaN (a client without test samples has NaN accuracy);
    NaN when none is."""
    vals = [x for x in (values or []) if x == x]
    return sum(vals) / len(vals) if vals else math.nan
