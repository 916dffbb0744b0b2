"""Runs that used to finish as if nothing were wrong: non-finite settings (`--lr nan`) and a trained
state that diverged to NaN are refused in one line and leave no complete-looking run directory;
two runs into one --out (two real processes) cannot both write it, and the lock vanishes with its
holder; a repeated seed is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import kill_helpers
import numpy as np
import pytest
from click.testing import CliRunner
from store_doubles import assert_one_line
from test_fedheads_cli import _write_store

from embedcache.errors import UserError
from fedheads.cli import main

WAIT = 300.0  # seconds: a bound on every wait for another process, ample at a load of 10 on 2 cores


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _write_store(tmp_path_factory.mktemp("guards"))


def _train(store: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "synth", "--rounds", "2",
                                     "--quiet", "--out", str(out), *extra])


def _arrays() -> dict:
    rng = np.random.default_rng(0)

    def one() -> tuple:
        return (rng.normal(size=(12, 4)).astype(np.float32), rng.integers(0, 3, 12),
                rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 3, 6))

    return {"a": one(), "b": one()}


@pytest.mark.parametrize("flag,value", [("--lr", "nan"), ("--lr", "inf"), ("--fraction", "-inf"),
                                        ("--set", "lr=NaN"), ("--set", "lp.weight_decay=Infinity")])
def test_cli_refuses_non_finite_settings(store, tmp_path, flag, value):
    shown = value.split("=")[0] if flag == "--set" else value
    alg = ["--algorithm", "lp"]
    res = _train(store, tmp_path / "r", *alg, flag, value)
    assert_one_line(res, 2, "must be a finite number", shown)
    assert not (tmp_path / "r").exists()
    res = CliRunner().invoke(main, ["compare", "--store", str(store), "--backbones", "synth", "--algorithms",
                                    "lp,mlp", "--quiet", "--out", str(tmp_path / "c"), flag, value])
    assert_one_line(res, 2, "must be a finite number")


def test_config_file_values_are_checked_too(store, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lr: .nan\n")
    res = _train(store, tmp_path / "r", "--algorithm", "lp", "--config", str(cfg))
    assert_one_line(res, 2, "run.yaml: lr=nan: must be a finite number")  # the file and its key named


def test_api_refuses_non_finite_settings(tmp_path):
    import fedheads

    with pytest.raises(UserError, match="fedheads.train: lr=nan: must be a finite number"):
        fedheads.train(_arrays(), "lp", rounds=1, seeds=0, lr=float("nan"))
    with pytest.raises(UserError, match="--set momentum=inf: must be a finite number"):
        fedheads.compare(_arrays(), ["lp", "mlp"], rounds=1, seeds=0, settings={"momentum": float("inf")})
    with pytest.raises(UserError, match="fraction=nan"):
        fedheads.train(_arrays(), "lp", rounds=1, seeds=0, fraction=float("nan"), out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_live_options_refuse_non_finite_settings():
    from fedheads.alignment.algorithm import FedDRAConfig
    from fedheads.alignment.dro import DROConfig
    from fedheads.alignment.runner import FedDRAOptions
    from fedheads.finetuning.algorithm import FTConfig
    from fedheads.finetuning.runner import FinetuneOptions

    with pytest.raises(UserError, match="--lr inf: must be a finite number"):
        FTConfig(lr=float("inf"))
    with pytest.raises(UserError, match="--server-lr nan"):
        FTConfig(server_lr=float("nan"))
    with pytest.raises(UserError, match="--fraction nan"):
        FinetuneOptions(fraction=float("nan"))
    with pytest.raises(UserError, match="--encoder-lr nan"):
        FedDRAConfig(encoder_lr=float("nan"))
    with pytest.raises(UserError, match="--tau inf"):
        FedDRAConfig(tau=float("inf"))
    with pytest.raises(UserError, match="rho nan"):
        FedDRAOptions(fd=FedDRAConfig(dro=DROConfig(rho=float("nan"))))


@pytest.mark.parametrize("args", [
    ["finetune", "--manifest", "m.json", "--store", "s.zarr", "--backbone", "resnet20-cifar10", "--set", "lr=nan"],
    ["finetune", "--manifest", "m.json", "--store", "s.zarr", "--backbone", "resnet20-cifar10", "--set", "momentum=inf"],
    ["feddra", "--manifest", "m.json", "--image-encoder", "resnet20-cifar10", "--text-encoder", "minilm-l6-v2",
     "--set", "mu=nan"],
    ["feddra", "--manifest", "m.json", "--image-encoder", "resnet20-cifar10", "--text-encoder", "minilm-l6-v2",
     "--set", "gamma=-Infinity"],
])
def test_live_cli_refuses_non_finite_settings(tmp_path, args):
    res = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "o")])
    assert_one_line(res, 2, f"--set {args[-1]}: must be a finite number")


def test_a_diverged_run_is_reported_failed_and_not_complete(store, tmp_path):
    """Finite settings can still train to NaN: the run fails, naming the seed and the field."""
    import fedheads

    out = tmp_path / "r"
    res = _train(store, out, "--algorithm", "fedavg", "--lr", "1e38", "--seeds", "3,4")
    assert_one_line(res, 2, "fedavg, seed 3", "not finite", "client.params")
    assert not (out / "results.json").exists() and not (out / "config.json").exists()
    with pytest.raises(UserError, match=r"lp, seed 0: training diverged.*client\.params"):
        fedheads.train(_arrays(), "lp", rounds=3, seeds=0, lr=1e38, settings={"optimizer_name": "sgd"})
    res = CliRunner().invoke(main, ["compare", "--store", str(store), "--backbones", "synth", "--algorithms",
                                    "fedncm,fedavg", "--rounds", "2", "--seeds", "0", "--lr", "1e38", "--quiet",
                                    "--out", str(tmp_path / "c")])
    assert_one_line(res, 2, "fedavg, seed 0", "not finite")
    assert not list((tmp_path / "c").rglob("results.json"))


def test_the_diverged_check_holds_no_full_size_temporary(monkeypatch):
    """The finiteness check of a trained state looks at bounded pieces of a large leaf (a
    1,000-client FedPCL state's projection weights), not at the whole of it at once: torch.isfinite
    and the sum of its mask copy their whole input. It still counts every NaN and infinity, in
    any piece, of contiguous and strided leaves alike."""
    import torch

    from fedheads.run.checks import check_trained_state

    seen: list[int] = []
    isfinite = torch.isfinite

    def spy(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.numel())
        return isfinite(t)

    monkeypatch.setattr(torch, "isfinite", spy)
    w = torch.zeros(4, 1 << 20)  # 4 Mi values
    check_trained_state({"client": {"w": w, "t": w.t()}, "server": {"step": torch.arange(3)}}, "fedpcl", 0)
    assert seen and max(seen) <= (1 << 20) and sum(seen) == 2 * w.numel()
    w[0, 0], w[2, 7], w[3, -1] = float("nan"), float("inf"), -float("inf")
    with pytest.raises(UserError, match=r"fedpcl, seed 0: .*client\.w: 3 of 4194304 values"):
        check_trained_state({"client": {"w": w}}, "fedpcl", 0)
    with pytest.raises(UserError, match=r"client\.t: 3 of 4194304 values"):
        check_trained_state({"client": {"t": w.t()}}, "fedpcl", 0)


def test_a_diverged_finetune_is_reported_failed(tmp_path_factory, tmp_path):
    import live_doubles

    from fedheads.finetuning.algorithm import FTConfig
    from fedheads.finetuning.runner import FinetuneOptions, finetune_run

    root = tmp_path_factory.mktemp("live")
    live_doubles.make_staged_store(root)
    opts = FinetuneOptions(rounds=1, ft=FTConfig(lr=1e38, batch_size=4), num_workers=0, progress=False, device="cpu")
    with pytest.raises(UserError, match=r"fedncm\+ft, seed 0: training diverged"):
        finetune_run(root / "manifest.json", str(root / "s.zarr"), "tiny-staged", tmp_path / "ft", opts)
    assert not (tmp_path / "ft" / "results.json").exists()


def test_repeated_seeds_are_refused(store, tmp_path):
    import fedheads
    from fedheads.alignment.runner import FedDRAOptions
    from fedheads.finetuning.runner import FinetuneOptions

    assert_one_line(_train(store, tmp_path / "r", "--algorithm", "lp", "--seeds", "0,0"), 2,
                    "--seeds 0,0", "more than once")
    with pytest.raises(UserError, match="seed 1 given more than once"):
        fedheads.train(_arrays(), "lp", rounds=1, seeds=[1, 2, 1])
    with pytest.raises(UserError, match="more than once"):
        FinetuneOptions(seeds=(0, 0))
    with pytest.raises(UserError, match="more than once"):
        FedDRAOptions(seeds=(5, 5))
    res = CliRunner().invoke(main, ["finetune", "--manifest", "m", "--store", "s", "--backbone", "resnet20-cifar10",
                                    "--seeds", "2,2", "--out", str(tmp_path / "f")])
    assert_one_line(res, 2, "--seeds 2,2")


PLUGIN = '''
import os, time
from pathlib import Path
from fedheads import register_algorithm
from fedheads.algorithms import create_algorithm


def waiting(**kw):
    """lp that, once training starts, says so and waits for the test's go-ahead."""
    inner = create_algorithm("lp", **kw)

    class Waiting(type(inner)):
        def init(self, *a, **kw):
            Path(os.environ["GUARD_READY"]).write_text(str(os.getpid()))
            deadline = time.monotonic() + float(os.environ["GUARD_WAIT"])
            while not Path(os.environ["GUARD_GO"]).exists():
                if time.monotonic() > deadline:
                    raise SystemExit("never told to go on")
                time.sleep(0.05)
            return super().init(*a, **kw)

    inner.__class__ = Waiting
    return inner


register_algorithm("waiting-lp", waiting, description="lp that waits")
'''


def _start_waiting(store: Path, out: Path, tmp: Path, tag: str) -> tuple[subprocess.Popen, Path, Path]:
    """A real `fedheads train` into `out` that holds its lock until `go` exists; returns once it
    is training (its `ready` file written), or fails the test."""
    (tmp / "guardplug.py").write_text(PLUGIN)
    ready, go = tmp / f"ready-{tag}", tmp / f"go-{tag}"
    env = kill_helpers.subprocess_env()
    env.update(PYTHONPATH=os.pathsep.join([str(tmp), env["PYTHONPATH"]]), GUARD_READY=str(ready), GUARD_GO=str(go),
               GUARD_WAIT=str(WAIT))
    proc = subprocess.Popen([sys.executable, "-m", "fedheads.cli", "--plugin", "guardplug", "train", "--store",
                             str(store), "--backbones", "synth", "--algorithm", "waiting-lp", "--rounds", "1",
                             "--seeds", "0", "--quiet", "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + WAIT
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"the first run ended before training: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the first run never started training")
        time.sleep(0.05)
    return proc, ready, go


def test_two_runs_into_one_out_cannot_both_write_it(store, tmp_path):
    out = tmp_path / "run"
    first, _, go = _start_waiting(store, out, tmp_path, "a")
    try:
        second = subprocess.run([sys.executable, "-m", "fedheads.cli", "train", "--store", str(store), "--backbones",
                                 "synth", "--algorithm", "fedncm", "--rounds", "1", "--seeds", "0", "--quiet",
                                 "--out", str(out)], env=kill_helpers.subprocess_env(), capture_output=True,
                                text=True, timeout=WAIT)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and str(out) in lines[0] and f"PID {first.pid}" in lines[0], second.stderr
    finally:
        go.write_text("")
        _, stderr = first.communicate(timeout=WAIT)
    assert first.returncode == 0, stderr
    import json

    assert json.loads((out / "results.json").read_text())["algorithm"] == "waiting-lp"
    assert not (out / ".fedheads.lock").exists()


def test_the_lock_vanishes_when_its_holder_is_killed(store, tmp_path):
    from fedheads.run import rundir

    out = tmp_path / "run"
    first, _, _ = _start_waiting(store, out, tmp_path, "b")
    with pytest.raises(UserError, match=f"another run is writing this directory \\(PID {first.pid}\\)"), \
            rundir.locked(out):
        pass
    first.kill()
    first.communicate(timeout=WAIT)
    with rundir.locked(out):  # no holder left: taken at once
        assert (out / ".fedheads.lock").read_text().strip() == str(os.getpid())
    assert_one_line(_train(store, out, "--algorithm", "fedncm", "--seeds", "0"), 0, "fedncm: accuracy")


def test_a_lock_leaves_no_directory_it_created_behind(tmp_path):
    """A run that writes nothing (refused, or failed before writing) removes the directories the
    lock created for it, parents included, and nothing that was there before."""
    from fedheads.run import rundir

    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "a" / "b" / "run"
    with rundir.locked(out):
        assert (out / rundir.LOCK).read_text().strip() == str(os.getpid())
    assert not (tmp_path / "kept" / "a").exists() and (tmp_path / "kept").is_dir()
