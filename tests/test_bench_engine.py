"""benchmarks/bench_engine.py: the figure is the ratio of medians over interleaved repeats, with
its spread, and both engines reach the same accuracy (they run the same definition)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import click
import pytest
from fed_tiny import tiny_fed

from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_engine as bench  # noqa: E402


def test_spread_quartiles() -> None:
    s = bench.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["q1"], s["q3"], s["iqr"], s["min"], s["max"]) == (3.0, 2.0, 4.0, 2.0, 1.0, 5.0)


def test_time_case_reports_ratio_of_medians_and_its_spread() -> None:
    case = bench.time_case(lambda: FedAvg(FedAvgConfig(hidden=4, batch_size=4)), tiny_fed(), repeats=3,
                           min_seconds=0.0, min_rounds=3)
    wall = {e: case[e]["wall_seconds"]["samples"] for e in bench.ENGINES}
    assert all(len(v) == 3 for v in wall.values()) and case["rounds"] == 3
    assert case["speedup"] == pytest.approx(statistics.median(wall["loop"]) / statistics.median(wall["vectorized"]))
    ratios = [lo / ve for lo, ve in zip(wall["loop"], wall["vectorized"])]
    assert case["speedup_per_repeat"]["samples"] == pytest.approx(ratios)
    assert case["vectorized"]["final_mean_acc"] == pytest.approx(case["loop"]["final_mean_acc"])
    assert len(case["load_average_before"]) == 3 and case["clients"] == 4
    rounds = {e: case[e]["training_round_seconds"]["samples"] for e in bench.ENGINES}
    assert case["speedup_training_round"] == pytest.approx(
        statistics.median(rounds["loop"]) / statistics.median(rounds["vectorized"]))


def test_thread_settings() -> None:
    assert bench.parse_threads("1,1") == [1]
    assert bench.parse_threads("all")[0] >= 1
    with pytest.raises(click.BadParameter):
        bench.parse_threads("-2")
