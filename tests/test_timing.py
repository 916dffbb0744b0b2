"""Runs record how long they took: per round (training vs evaluation, wall and CPU) in the
engine, the whole command, each seed and the machine in results.json, a line in summary.md."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from click.testing import CliRunner
from fed_tiny import tiny_fed

from embedcache.store.importer import import_features
from fedheads.algorithms.fedavg import FedAvg, FedAvgConfig
from fedheads.cli import main
from fedheads.core import run


def test_engine_times_training_and_evaluation_separately() -> None:
    res = run(FedAvg(FedAvgConfig(hidden=8, batch_size=4)), tiny_fed(), rounds=4, eval_every=2, progress=False)
    h = res.history
    assert all(r.seconds > 0 and r.cpu_seconds >= 0 for r in h)
    assert [r.eval_seconds > 0 for r in h] == [False, True, False, True]  # evaluated after rounds 2 and 4
    assert all(r.eval_seconds == r.eval_cpu_seconds == 0 for r in h if r.accuracy is None)
    assert sum(r.seconds + r.eval_seconds for r in h) <= res.wall_seconds
    assert res.cpu_seconds > 0


def test_results_json_and_summary_record_the_timing(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    store = tmp_path / "st.zarr"
    for c in ("a", "b"):
        for split, n in (("train", 20), ("test", 8)):
            y = rng.integers(0, 3, n)
            np.savez(tmp_path / f"{c}{split}.npz", features=(np.eye(3, 6)[y] * 3 + rng.normal(size=(n, 6))).astype("f4"),
                     labels=y)
            import_features(store, tmp_path / f"{c}{split}.npz", backbone="s", client=c, split=split, domain=c,
                            classes=["k0", "k1", "k2"])
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "s", "--algorithm", "fedavg",
                                  "--rounds", "3", "--seeds", "0,1", "--eval-every", "2", "--device", "cpu",
                                  "--quiet", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    t = json.loads((out / "results.json").read_text())["timing"]
    assert t["wall_seconds"] >= sum(s["wall_seconds"] for s in t["per_seed"]) > 0
    assert t["cpu_seconds"] > 0 and t["load_wall_seconds"] > 0 and t["load_cpu_seconds"] >= 0
    assert [s["seed"] for s in t["per_seed"]] == [0, 1]
    for s in t["per_seed"]:
        rounds = s["rounds"]
        assert all(len(v) == 3 for v in rounds.values())
        assert [x > 0 for x in rounds["eval_wall_seconds"]] == [False, True, True]  # every 2nd and the last
        assert s["train_wall_seconds"] == sum(rounds["train_wall_seconds"]) or abs(
            s["train_wall_seconds"] - sum(rounds["train_wall_seconds"])) < 1e-3
        assert s["train_wall_seconds"] + s["eval_wall_seconds"] <= s["wall_seconds"] + 1e-3
    m = t["machine"]
    assert m["device"] == "cpu" and m["gpu"] is None and m["threads"] == torch.get_num_threads()
    assert m["cpu_count"] >= 1 and m["torch"] == torch.__version__ and m["cpu_model"]
    md = (out / "summary.md").read_text()
    assert "- time: " in md and "s CPU for 2 seed(s)" in md and "threads on" in md
