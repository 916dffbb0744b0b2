"""`fedheads train/compare --resume`: a run interrupted after any round and resumed ends with the
same states, curves and accuracies as an uninterrupted one (every algorithm, in process; and
`fedheads train` killed with SIGKILL mid-run, as a subprocess), and a checkpoint of other settings
is refused with one line naming what differs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import kill_helpers
import pytest
import torch
from click.testing import CliRunner
from fed_tiny import tiny_fed
from test_fedheads_cli import _write_store

from embedcache.errors import UserError
from fedheads.algorithms import list_algorithms
from fedheads.cli import main
from fedheads.core.tree import tree_leaves
from fedheads.run import checkpoint as resume
from fedheads.run.train import TrainOptions, rounds_needed, train_data


class _Stop(Exception):
    pass


def _interrupt_after(monkeypatch, at: int) -> None:
    orig = resume.HeadCheckpoint.save

    def save(self, state):
        orig(self, state)
        if state.round == at:
            raise _Stop

    monkeypatch.setattr(resume.HeadCheckpoint, "save", save)


def _leaves(trained, seed: int = 0) -> list[torch.Tensor]:
    return tree_leaves((trained.states[seed].client_state, trained.states[seed].server_state))


@pytest.mark.parametrize("engine", ["vectorized", "loop"])
@pytest.mark.parametrize("name", [i.name for i in list_algorithms()])
def test_interrupted_and_resumed_equals_uninterrupted(name, engine, tmp_path, monkeypatch):
    data = tiny_fed()
    opts = TrainOptions(rounds=4, seeds=(0,), progress=False, device="cpu", engine=engine)
    if rounds_needed(name, opts) < opts.rounds:  # a one-pass head trains every round only with clients sampled
        opts = replace(opts, fraction=0.5)
    ref = train_data(data, ["f"], name, opts)
    with monkeypatch.context() as m:
        _interrupt_after(m, 2)
        with pytest.raises(_Stop):
            train_data(data, ["f"], name, opts, state_dir=tmp_path)
    got = train_data(data, ["f"], name, opts, state_dir=tmp_path, resume=True)
    a, b = _leaves(ref), _leaves(got)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    assert got.result["history"] == ref.result["history"] and got.result["per_client"] == ref.result["per_client"]
    assert got.result["timing"]["per_seed"][0]["resumed_from_round"] == 2
    assert ref.result["timing"]["per_seed"][0]["resumed_from_round"] is None


def test_other_settings_are_refused_naming_what_differs(tmp_path):
    data = tiny_fed()
    opts = TrainOptions(rounds=3, seeds=(0,), progress=False, device="cpu", settings=(("lr", 0.05),))
    train_data(data, ["f"], "lp", opts, state_dir=tmp_path)
    with pytest.raises(UserError, match=r"seed0.ckpt.pt: written by a run with other settings \(algorithm_config.optimizer.lr: "
                                        r"0.05 -> 0.1\); resume.*start over with --overwrite"):
        train_data(data, ["f"], "lp", TrainOptions(rounds=3, seeds=(0,), progress=False, device="cpu",
                                                   settings=(("lr", 0.1),)), state_dir=tmp_path, resume=True)
    with pytest.raises(UserError, match=r"options.rounds: 3 -> 5"):
        train_data(data, ["f"], "lp", TrainOptions(rounds=5, seeds=(0,), progress=False, device="cpu",
                                                   settings=(("lr", 0.05),)), state_dir=tmp_path, resume=True)
    other = tiny_fed(seed=1)
    with pytest.raises(UserError, match=r"data\."):
        train_data(other, ["f"], "lp", opts, state_dir=tmp_path, resume=True)


_TRAIN = """
import sys
from fedheads.cli import main
sys.argv = ["fedheads", "train", "--store", {store!r}, "--backbones", "synth", "--algorithm", "fedpcl",
            "--rounds", "4", "--seeds", "0,1", "--device", "cpu", "--quiet", "--out", {out!r}] + {extra!r}
try:
    main()
except SystemExit as e:
    print("EXIT", e.code, flush=True)
"""


def test_kill_minus_9_mid_run_then_resume_gives_the_same_results(tmp_path):
    store = _write_store(tmp_path)

    def script(out: Path, extra: list[str], delay: float) -> str:
        # killed in the sleep after seed 1's round-2 checkpoint: seed 0 is done, seed 1 half way
        return kill_helpers.stop_after("fedheads.run.checkpoint:HeadCheckpoint", "a[0].round", 2, delay, occurrence=2) + \
            _TRAIN.format(store=str(store), out=str(out), extra=extra)

    ref = kill_helpers.run_script(script(tmp_path / "ref", [], 0.0))
    assert "EXIT 0" in ref.stdout, ref.stderr[-2000:]
    kill_helpers.kill_at(script(tmp_path / "killed", [], 60.0), "ROUND 2", occurrence=2)
    killed = tmp_path / "killed"
    assert not (killed / "results.json").exists()
    assert torch.load(killed / "state" / "seed1.ckpt.pt", weights_only=True)["round"] == 2
    res = CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpcl",
                                    "--rounds", "4", "--seeds", "0,1", "--device", "cpu", "--quiet", "--out",
                                    str(killed)])
    assert res.exit_code == 2 and "holds an interrupted run" in res.output and "--resume" in res.output
    done = kill_helpers.run_script(script(killed, ["--resume"], 0.0))
    assert "EXIT 0" in done.stdout, done.stderr[-2000:]
    a, b = (json.loads((d / "results.json").read_text()) for d in (tmp_path / "ref", killed))
    for key in ("history", "per_client", "accuracy", "fairness", "communication", "other_rules"):
        assert a[key] == b[key], key
    assert [s["resumed_from_round"] for s in b["timing"]["per_seed"]] == [4, 2]
    for seed in (0, 1):
        sa, sb = (torch.load(d / "state" / f"seed{seed}.pt", weights_only=True) for d in (tmp_path / "ref", killed))
        assert all(torch.equal(x, y) for x, y in zip(sa["client"] + sa["server"], sb["client"] + sb["server"]))
    assert (tmp_path / "ref" / "metrics.csv").read_text() == (killed / "metrics.csv").read_text()


def test_an_interrupted_comparison_resumes_to_the_same_table(tmp_path, monkeypatch):
    from fedheads.run.train import compare_runs

    data, names = tiny_fed(), ["fedpcl", "lp"]
    opts = TrainOptions(rounds=3, seeds=(0,), progress=False, device="cpu")
    ref = compare_runs(None, ["f"], names, opts, tmp_path / "ref", data=data)
    with monkeypatch.context() as m:
        _interrupt_after(m, 2)
        with pytest.raises(_Stop):
            compare_runs(None, ["f"], names, opts, tmp_path / "cmp", data=data)
    with pytest.raises(UserError, match="holds an interrupted run.*--resume"):
        compare_runs(None, ["f"], names, opts, tmp_path / "cmp", data=data)
    with pytest.raises(UserError, match="--resume and --overwrite: give one"):
        compare_runs(None, ["f"], names, opts, tmp_path / "cmp", data=data, resume=True, overwrite=True)
    got = compare_runs(None, ["f"], names, opts, tmp_path / "cmp", data=data, resume=True)
    again = compare_runs(None, ["f"], names, opts, tmp_path / "cmp", data=data, resume=True)  # a finished one
    assert again["algorithms"]["lp"]["history"] == ref["algorithms"]["lp"]["history"]
    for f in (tmp_path / "ref").rglob("*.ckpt.pt"):
        f.unlink()  # a run without checkpoints (written before they existed) is not resumed over
    with pytest.raises(UserError, match="holds a comparison of fedpcl, lp .*without checkpoints: nothing to resume"):
        compare_runs(None, ["f"], names, opts, tmp_path / "ref", data=data, resume=True)
    for n in names:
        assert got["algorithms"][n]["history"] == ref["algorithms"][n]["history"]
    assert [got["algorithms"][n]["timing"]["per_seed"][0]["resumed_from_round"] for n in names] == [2, None]
