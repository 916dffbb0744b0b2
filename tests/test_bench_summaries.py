"""The benchmarks' own arithmetic: bench_feddra's per-seed paired comparison (exact sign test)
and bench_pipelines' sums over distinct cells. Whole file: well under a second."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_feddra  # noqa: E402
import bench_pipelines  # noqa: E402


def test_paired_sign_test() -> None:
    a = {s: {"mean": 10.0 + s, "worst": 5.0 + (s % 2)} for s in range(4)}
    b = {s: {"mean": 9.0, "worst": 5.0} for s in range(5)}  # seed 4 only in b: left out
    c = bench_feddra._paired(a, b)
    assert c["seeds"] == [0, 1, 2, 3]
    assert c["mean"]["wins"] == 4 and c["mean"]["losses"] == 0
    assert c["mean"]["sign_test_p"] == pytest.approx(2 / 16)  # two-sided: 2 * (1/2)^4
    assert c["mean"]["diff_mean"] == pytest.approx(2.5)
    w = c["worst"]  # seeds 1 and 3 win by 1, seeds 0 and 2 tie: ties are left out of the test
    assert (w["wins"], w["losses"], w["ties"]) == (2, 0, 2)
    assert w["sign_test_p"] == pytest.approx(0.5)
    even = bench_feddra._paired({0: {"mean": 1, "worst": 1}, 1: {"mean": 0, "worst": 0}},
                                {0: {"mean": 0, "worst": 0}, 1: {"mean": 1, "worst": 1}})
    assert even["mean"]["sign_test_p"] == 1.0  # one win, one loss: capped at 1


def test_per_seed_reads_the_last_round(tmp_path: Path) -> None:
    rows = ["round,seed,client,t2i_r1", "0,0,a,1.0", "0,0,b,2.0", "1,0,a,4.0", "1,0,b,6.0", "1,1,a,3.0", "1,1,b,1.0"]
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    assert bench_feddra._per_seed(tmp_path) == {0: {"mean": 5.0, "worst": 4.0}, 1: {"mean": 2.0, "worst": 1.0}}


def test_methods_part_runs_the_papers_fedavg_and_the_two_stage_one_beside_it() -> None:
    """By default the methods part runs FedAvg as the paper does (one stage) and, beside it, FedAvg
    with FedDRA's two-stage schedule: the schedule's share of FedDRA's lead is measured, not assumed."""
    from fedheads.alignment.runner import BASELINES

    default = next(p.default for p in bench_feddra.main.params if p.name == "methods").split(",")
    assert {"feddra", "fedavg", "fedavg-two-stage"} <= set(default)
    assert BASELINES["fedavg"]["two_stage"] is False and "two_stage" not in BASELINES["fedavg-two-stage"]


def test_pipelines_summary_counts_shared_cells_once(tmp_path: Path) -> None:
    (tmp_path / "cells").mkdir()
    for h, alg, cpu in (("h1", "fedavg", 60.0), ("h2", "fedpcl", 30.0), ("h3", "fedavg", 30.0)):
        (tmp_path / "cells" / f"{h}.json").write_text(json.dumps({"config": {"algorithm": alg},
                                                                   "timing": {"cpu_seconds": cpu}}))
    cpu = bench_pipelines.cell_cpu(tmp_path, ["h1", "h2", "h3", "missing"])
    res = {"experiments": {
        "e1": {"warm": {"timing": {"sweep_seconds": 60, "cells": 2}}, "warm_serial": {"timing": {"sweep_seconds": 120}}},
        "e2": {"warm": {"timing": {"sweep_seconds": 30, "cells": 2}}}}}
    s = bench_pipelines.summary(res, cpu)
    assert s["unique_cells"] == 3 and s["unique_cell_cpu_minutes"] == 2.0
    assert s["cpu_minutes_per_algorithm"] == {"fedavg": 1.5, "fedpcl": 0.5}
    assert s["sweep_minutes_sum_of_experiments"] == 1.5 and s["cells_per_experiment_total"] == 4
    assert s["sweep_minutes_sum_under"] == {"serial": 2.0}


def test_retrain_drops_only_the_named_algorithms_cells_once(tmp_path: Path) -> None:
    """--retrain: the named algorithms' cells of an experiment lose their result files (so a run
    without --force re-trains them); a cell shared with an experiment handled before is kept."""
    (tmp_path / "cells").mkdir()
    for h, alg in (("h1", "fedrep"), ("h2", "fedavg"), ("h3", "pfedme")):
        (tmp_path / "cells" / f"{h}.json").write_text(json.dumps({"config": {"algorithm": alg}}))
    for name, hashes in (("e1", ["h1", "h2"]), ("e2", ["h1", "h3", "h2"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"cells": [{"hash": h} for h in hashes]}))
    done: set[str] = set()
    first = bench_pipelines.drop_cells(tmp_path, "e1", {"fedrep", "pfedme"}, done)
    assert first == ["h1"] and not (tmp_path / "cells" / "h1.json").exists()
    done.update(first)
    (tmp_path / "cells" / "h1.json").write_text(json.dumps({"config": {"algorithm": "fedrep"}}))  # re-trained
    assert bench_pipelines.drop_cells(tmp_path, "e2", {"fedrep", "pfedme"}, done) == ["h3"]
    assert (tmp_path / "cells" / "h1.json").is_file() and (tmp_path / "cells" / "h2.json").is_file()
