"""results.json summary, paper-style Markdown tables and PNG plots."""

from __future__ import annotations

import json

import pytest

from embedcache.errors import UserError
from fedheads import report as R


def _seeds():
    led = {"upload_params_per_client_per_round": 2560.0, "upload_bytes_total": 10240 * 4,
           "download_bytes_total": 10240 * 4}
    return [
        {"seed": 0, "per_client": {"MNIST": 80.0, "SVHN": 20.0}, "communication": led,
         "history": [{"round": 1, "accuracy": 40.0}, {"round": 2, "accuracy": 50.0}],
         "trainable_params_per_client": 131_072},
        {"seed": 1, "per_client": {"MNIST": 84.0, "SVHN": 16.0}, "communication": led,
         "history": [{"round": 1, "accuracy": 44.0}, {"round": 2, "accuracy": 50.0}],
         "trainable_params_per_client": 131_072},
    ]


def test_summarise_runs_contract_keys_and_values():
    r = R.summarise_runs(_seeds(), algorithm="fedpcl", backbones=["a"], rounds=2,
                         feature_dims=[512], num_classes=10)
    for k in ("algorithm", "backbones", "rounds", "seeds", "accuracy", "per_client", "fairness",
              "communication", "trainable_params_per_client",
              "paper_trainable_params_per_client", "history"):
        assert k in r
    assert r["accuracy"] == {"mean": 50.0, "std": 0.0}
    assert r["per_client"]["MNIST"] == {"mean": 82.0, "std": 2.0}
    assert r["fairness"]["worst_10"] == 18.0 and r["fairness"]["best_10"] == 82.0
    assert r["fairness"]["variance"] == 32.0      # std of (80,20)=30, of (84,16)=34
    c = r["communication"]
    assert c["paper_comm_params_per_client_per_round"] == 2_560
    assert c["paper_total_bytes"] == 2 * 2560 * 2 * 2 * 4
    assert c["upload_params_per_client_per_round"] == 2560.0
    assert r["paper_trainable_params_per_client"] == 131_072
    assert r["history"] == [{"round": 1, "accuracy": 42.0, "std": 2.0},
                            {"round": 2, "accuracy": 50.0, "std": 0.0}]
    json.dumps(r)  # JSON-able


def test_fedncm_counts_one_round():
    r = R.summarise_runs(_seeds(), algorithm="fedncm", backbones=["a"], rounds=50,
                         feature_dims=[512], num_classes=10)
    assert r["communication"]["paper_total_bytes"] == 2 * 5120 * 2 * 1 * 4


def test_summarise_runs_rejects_empty():
    with pytest.raises(UserError, match="no seed"):
        R.summarise_runs([], algorithm="x", backbones=[], rounds=1)
    with pytest.raises(UserError, match="seed #0"):
        R.summarise_runs([{"seed": 0}], algorithm="x", backbones=[], rounds=1)


def test_comparison_markdown_layout():
    a = R.summarise_runs(_seeds(), algorithm="FedAvg", backbones=["a"], rounds=2,
                         feature_dims=[512], num_classes=10)
    b = R.summarise_runs(_seeds(), algorithm="Solo", backbones=["a"], rounds=2,
                         feature_dims=[512], num_classes=10)
    md = R.comparison_markdown([a, b], clients=["MNIST", "SVHN"])
    lines = md.splitlines()
    assert lines[0] == "| Method | MNIST | SVHN | Avg | # of Comm Params |"
    assert lines[2] == "| FedAvg | 82.00(2.00) | 18.00(2.00) | 50.00(0.00) | 133,632 |"
    assert lines[3].endswith("| - |")
    assert "| Method | Average | Worst 10% |" in md


def test_writers_produce_files(tmp_path):
    a = R.summarise_runs(_seeds(), algorithm="fedpcl", backbones=["a"], rounds=2)
    paths = R.write_comparison([a], tmp_path / "cmp")
    for p in paths.values():
        assert p.exists() and p.stat().st_size > 0
    assert paths["history_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    j = R.write_results_json(a, tmp_path / "results.json")
    assert json.loads(j.read_text())["algorithm"] == "fedpcl"
    md = R.run_markdown(a)
    assert "# fedpcl on a" in md and "50.00(0.00)" in md
    assert not list(tmp_path.rglob("*.tmp"))
