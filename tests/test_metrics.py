"""Hand-computed checks of the papers' metrics (FedPCL Tables 2, 12-13)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from embedcache.errors import UserError
from fedheads.report import metrics as M


def test_accuracy_percent_and_errors():
    assert M.accuracy(np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4])) == 75.0
    with pytest.raises(UserError, match="lengths differ"):
        M.accuracy(np.array([1, 2]), np.array([1]))
    with pytest.raises(UserError, match="empty"):
        M.accuracy(np.array([]), np.array([]))


def test_per_client_accuracy_and_mismatch():
    got = M.per_client_accuracy({"a": np.array([0, 1]), "b": np.array([2])},
                                {"a": np.array([0, 0]), "b": np.array([2])})
    assert got == {"a": 50.0, "b": 100.0}
    with pytest.raises(UserError, match="c: client present"):
        M.per_client_accuracy({"a": np.array([0])}, {"a": np.array([0]), "c": np.array([1])})


def test_format_matches_paper_cells():
    assert M.format_mean_std(82.75, 0.4) == "82.75(0.40)"
    assert M.format_mean_std(91.74, 0.0) == "91.74(0.00)"
    # three seeds 82, 83, 84: sample std sqrt(((-1)^2 + 0 + 1^2) / (3 - 1)) = 1
    m, s = M.mean_std([82.0, 83.0, 84.0])
    assert (m, s) == (83.0, pytest.approx(1.0))
    assert M.format_mean_std(m, s) == "83.00(1.00)"
    assert M.mean_std([82.0, 83.0, 84.0], ddof=0)[1] == pytest.approx(math.sqrt(2 / 3))
    assert M.mean_std([5.0]) == (5.0, 0.0)  # one seed: 0, not NaN


def test_std_over_seeds_is_torch_std_like_the_fedpcl_authors():
    # 82, 83, 85: mean 250/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9, / (3-1) -> 7/3
    import torch

    vals = [82.0, 83.0, 85.0]
    assert M.STD_DDOF == 1
    assert M.mean_std(vals)[1] == pytest.approx(math.sqrt(7 / 3))
    assert M.mean_std(vals)[1] == pytest.approx(float(torch.tensor(vals, dtype=torch.float64).std()))
    overall, _ = M.summarise_accuracy([{"a": v} for v in vals])
    assert overall["std"] == pytest.approx(math.sqrt(7 / 3))


def test_fairness_hand_computed_ten_clients():
    accs = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    f = M.fairness(accs)
    assert f.average == 55.0
    assert f.worst_10 == 10.0            # 1 client
    assert f.worst_20 == 15.0            # (10+20)/2
    assert f.worst_40 == 25.0            # (10+20+30+40)/4
    assert f.best_10 == 100.0
    # population std of 10..100 step 10 = 10*sqrt(8.25)
    assert f.variance == pytest.approx(28.722813232690143)
    assert f.var_pp2 == pytest.approx(825.0)


@pytest.mark.parametrize("accs,k", [
    ([10, 20, 30, 40, 50], {"worst_10": 1, "worst_20": 1, "worst_40": 2, "best_10": 1}),
    ([10, 20, 30, 40], {"worst_10": 1, "worst_20": 1, "worst_40": 1, "best_10": 1}),
    (list(range(40)), {"worst_10": 4, "worst_20": 8, "worst_40": 16, "best_10": 4}),  # Table 12
])
def test_fairness_fraction_rounding_with_few_clients(accs, k):
    # k = max(1, floor(q * n)) clients: 5 clients -> 1/1/2/1, 4 clients -> 1/1/1/1
    f = M.fairness(accs).as_dict()
    srt = sorted(accs)
    for key, n in k.items():
        want = srt[-n:] if key == "best_10" else srt[:n]
        assert f[key] == pytest.approx(sum(want) / n), key


def test_fairness_at_least_one_client_and_order_free():
    f = M.fairness({"x": 70.0, "y": 30.0, "z": 50.0})
    assert f.worst_10 == f.worst_20 == 30.0   # floor(0.3)=0 -> 1 client
    assert f.worst_40 == 30.0                  # floor(1.2)=1
    assert f.best_10 == 70.0
    assert M.worst_fraction_mean([3, 1, 2, 4, 5], 0.4) == 1.5
    with pytest.raises(UserError, match="q=0"):
        M.worst_fraction_mean([1.0], 0.0)


def test_fairness_over_seeds_mean_std():
    s1 = {"a": 40.0, "b": 60.0}
    s2 = {"a": 50.0, "b": 70.0}
    out = M.fairness_over_seeds([s1, s2])
    r2 = math.sqrt(2)  # sample std of two values 10 apart: 10 / sqrt(2)
    assert out["average"] == {"mean": 55.0, "std": pytest.approx(5 * r2)}
    assert out["worst_10"] == {"mean": 45.0, "std": pytest.approx(5 * r2)}
    assert out["variance"] == {"mean": 10.0, "std": 0.0}  # within a run: population std of (40, 60)
    assert M.fairness_over_seeds([s1, s2], ddof=0)["average"]["std"] == 5.0
    assert set(M.FAIRNESS_KEYS) <= set(out)


def test_summarise_accuracy_avg_column_semantics():
    # seed averages 50 and 60 -> 55(7.07); client a: 40/60 -> 50(14.14); b: 60/60 -> 60(0)
    overall, per_client = M.summarise_accuracy([{"a": 40.0, "b": 60.0}, {"a": 60.0, "b": 60.0}])
    assert overall == {"mean": 55.0, "std": pytest.approx(5 * math.sqrt(2))}
    assert per_client == {"a": {"mean": 50.0, "std": pytest.approx(10 * math.sqrt(2))},
                          "b": {"mean": 60.0, "std": 0.0}}
    with pytest.raises(UserError, match="seed #1"):
        M.summarise_accuracy([{"a": 1.0}, {"b": 1.0}])


def test_aggregate_history_common_rounds():
    h1 = [{"round": 1, "accuracy": 10.0}, {"round": 2, "accuracy": 20.0}]
    h2 = [{"round": 1, "accuracy": 30.0}, {"round": 2, "accuracy": 40.0},
          {"round": 3, "accuracy": 50.0}]
    got = M.aggregate_history([h1, h2], ddof=0)
    assert got == [{"round": 1, "accuracy": 20.0, "std": 10.0},
                   {"round": 2, "accuracy": 30.0, "std": 10.0}]
    assert M.aggregate_history([h1, h2])[0]["std"] == pytest.approx(10 * math.sqrt(2))
    with pytest.raises(UserError, match="seed #0"):
        M.aggregate_history([[{"round": 1}]])
