"""Hand-computed checks of the papers' metrics (FedPCL Tables 2, 12-13)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from embedcache.errors import UserError
from fedheads import metrics as M


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
    # mean/std of three seeds 82, 83, 84 -> population std sqrt(2/3)
    m, s = M.mean_std([82.0, 83.0, 84.0])
    assert (m, s) == (83.0, pytest.approx(math.sqrt(2 / 3)))
    assert M.format_mean_std(m, s) == "83.00(0.82)"
    assert M.mean_std([82.0, 83.0, 84.0], ddof=1)[1] == pytest.approx(1.0)
    assert M.mean_std([5.0]) == (5.0, 0.0)


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
    assert out["average"] == {"mean": 55.0, "std": 5.0}
    assert out["worst_10"] == {"mean": 45.0, "std": 5.0}
    assert out["variance"] == {"mean": 10.0, "std": 0.0}
    assert set(M.FAIRNESS_KEYS) <= set(out)


def test_summarise_accuracy_avg_column_semantics():
    # seed averages 50 and 60 -> 55(5); client a: 40/60 -> 50(10); b: 60/60 -> 60(0)
    overall, per_client = M.summarise_accuracy([{"a": 40.0, "b": 60.0}, {"a": 60.0, "b": 60.0}])
    assert overall == {"mean": 55.0, "std": 5.0}
    assert per_client == {"a": {"mean": 50.0, "std": 10.0}, "b": {"mean": 60.0, "std": 0.0}}
    with pytest.raises(UserError, match="seed #1"):
        M.summarise_accuracy([{"a": 1.0}, {"b": 1.0}])


def test_aggregate_history_common_rounds():
    h1 = [{"round": 1, "accuracy": 10.0}, {"round": 2, "accuracy": 20.0}]
    h2 = [{"round": 1, "accuracy": 30.0}, {"round": 2, "accuracy": 40.0},
          {"round": 3, "accuracy": 50.0}]
    got = M.aggregate_history([h1, h2])
    assert got == [{"round": 1, "accuracy": 20.0, "std": 10.0},
                   {"round": 2, "accuracy": 30.0, "std": 10.0}]
    with pytest.raises(UserError, match="seed #0"):
        M.aggregate_history([[{"round": 1}]])
