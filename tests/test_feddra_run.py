"""`fedheads feddra` end to end on the test doubles: the run directory and results contract,
kill -9 then --resume ends with identical weights and lambda, and bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kill_helpers
import pytest
import torch
import vl_doubles

from embedcache.errors import UserError
from embedcache.manifest import save_manifest
from fedheads.alignment.algorithm import FedDRAConfig
from fedheads.alignment.dro import DROConfig
from fedheads.alignment.probe import ProbeOptions
from fedheads.alignment.runner import FedDRAOptions, feddra_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    root = tmp_path_factory.mktemp("feddra_run")
    m, store = vl_doubles.make_paired(root)
    save_manifest(m, root / "m.json")
    return root, m, store


def _opts(**kw) -> FedDRAOptions:
    base = dict(fd=FedDRAConfig(rounds=2, steps=2, batch_size=4, dro=DROConfig(rho=1.0)), image_cut="stem",
                num_workers=0, progress=False, device="cpu")
    base.update(kw)
    return FedDRAOptions(**base)


def _ckpt(out: Path, seed: int = 0) -> dict:
    return torch.load(out / "state" / f"seed{seed}.ckpt.pt", weights_only=True)


def test_run_directory_and_results_contract(paired, tmp_path):
    root, m, store = paired
    probe = ProbeOptions(manifest=str(root / "m.json"), shots=(1,), draws=2, rounds=2, features=("z", "pooled"))
    res = feddra_run(root / "m.json", store, "tiny-staged", "tinytext", tmp_path / "run",
                     _opts(baselines=("feddra", "fedavg"), probe=probe))
    assert set(res["algorithms"]) == {"feddra", "fedavg"}
    for name, r in res["algorithms"].items():
        d = tmp_path / "run" / name
        for f in ("results.json", "config.json", "metrics.csv", "summary.md", "lambda.png",
                  "retrieval_per_client.png", "retrieval_per_round.png", "encoders/image-seed0.pt",
                  "encoders/text-seed0.pt", "state/seed0.ckpt.pt"):
            assert (d / f).is_file(), f
        assert set(r["per_client"]) == {c.name for c in m.clients}
        assert r["accuracy"]["mean"] == pytest.approx(r["retrieval"]["t2i_r1"]["mean"]["mean"])
        assert len(r["lambda"]["per_seed"]["0"]) == 3 and len(r["lambda"]["final_mean"]) == 3  # rounds 0..2
        assert r["chance"]["r1"] == pytest.approx(100 / 9)  # 9 test pairs per client
        assert set(r["communication_per_stage"]) == ({"stage2"} if name == "fedavg" else {"stage1", "stage2"})
        assert set(r["probe"]["z"]) == set(r["probe"]["pooled"]) == {"1"}  # pooled: through the ckpt: file
        blob = torch.load(d / "encoders" / "image-seed0.pt", weights_only=True)
        assert blob["format"] == "embedcache-ckpt-backbone/1" and blob["base"] == "tiny-staged"
        assert torch.load(d / "encoders" / "text-seed0.pt", weights_only=True)["base"] == "tinytext"
    assert res["algorithms"]["fedavg"]["lambda"]["final_mean"] == [1 / 3] * 3
    assert res["algorithms"]["feddra"]["lambda"]["final_mean"] != [1 / 3] * 3
    assert (tmp_path / "run" / "summary.md").read_text().count("| feddra |") == 1
    # a finished directory is never overwritten silently
    with pytest.raises(UserError, match="holds .*--resume.*--overwrite"):
        feddra_run(root / "m.json", store, "tiny-staged", "tinytext", tmp_path / "run" / "feddra", _opts())


_KILL_SCRIPT = """
import vl_doubles
from fedheads.alignment.dro import DROConfig
from fedheads.alignment.algorithm import FedDRAConfig
from fedheads.alignment.runner import FedDRAOptions, feddra_run
opts = FedDRAOptions(fd=FedDRAConfig(rounds=4, steps=2, batch_size=4, dro=DROConfig(rho=1.0)), image_cut="stem",
                     num_workers=0, progress=False, device="cpu", resume={resume})
feddra_run({manifest!r}, {store!r}, "tiny-staged", "tinytext", {out!r}, opts)
print("DONE", flush=True)
"""


def test_kill_minus_9_then_resume_is_identical(paired, tmp_path):
    root, _, store = paired

    def script(out: Path, resume: bool, delay: float) -> str:
        # killed in the sleep after round 2's checkpoint, before round 3
        return kill_helpers.stop_after("fedheads.finetuning.rounds:Checkpoint", "a[1][-1].round", 2, delay) + \
            _KILL_SCRIPT.format(manifest=str(root / "m.json"), store=store, out=str(out), resume=resume)

    assert "DONE" in kill_helpers.run_script(script(tmp_path / "ref", False, 0.0)).stdout
    kill_helpers.kill_at(script(tmp_path / "killed", False, 60.0), "ROUND 2")
    assert not (tmp_path / "killed" / "results.json").exists()
    assert _ckpt(tmp_path / "killed")["round"] == 2
    done = kill_helpers.run_script(script(tmp_path / "killed", True, 0.0))
    assert "DONE" in done.stdout, done.stderr[-2000:]
    a, b = _ckpt(tmp_path / "ref"), _ckpt(tmp_path / "killed")
    assert a["round"] == b["round"] == 4
    for part in ("params", "buffers"):
        assert vl_doubles.live_doubles.digest(a[part]) == vl_doubles.live_doubles.digest(b[part])
    assert torch.equal(a["opt"][0], b["opt"][0]) and a["opt"][0].dtype == torch.float64  # lambda
    assert a["history"][-1]["lam"] == b["history"][-1]["lam"] != [1 / 3] * 3
    res = json.loads((tmp_path / "killed" / "results.json").read_text())
    assert res["timing"]["per_seed"][0]["resumed_from_round"] == 2


def test_bad_input_is_one_line(paired, tmp_path):
    import dataclasses

    root, m, store = paired
    run = lambda *a, **kw: feddra_run(root / "m.json", store, *a, tmp_path / "x", _opts(**kw))  # noqa: E731
    with pytest.raises(UserError, match="not a text encoder"):
        run("tiny-staged", "tiny-staged")
    with pytest.raises(UserError, match="tinytext-frozen: cannot be fine-tuned"):
        run("tiny-staged", "tinytext-frozen")
    # ... fine when nothing trains it: a stage-1-only run, or the text encoder kept frozen
    feddra_run(root / "m.json", None, "tiny-staged", "tinytext-frozen", tmp_path / "s1",
               _opts(fd=FedDRAConfig(rounds=1, steps=1, batch_size=4, schedule="sequential", stage1_rounds=1)))
    with pytest.raises(UserError, match="image_trainable 'after:pool'"):
        run("tiny-staged", "tinytext", image_trainable="after:pool")
    with pytest.raises(UserError, match="--baseline 'fedsgd'"):
        run("tiny-staged", "tinytext", baselines=("fedsgd",))
    # a sample without its text, named
    c0 = m.clients[0]
    bad = dataclasses.replace(m, clients=(dataclasses.replace(c0, train=(dataclasses.replace(c0.train[0], text=None),
                                                                         *c0.train[1:])), *m.clients[1:]))
    with pytest.raises(UserError, match=f"{c0.name}/train/{c0.train[0].id}: no text"):
        feddra_run(bad, store, "tiny-staged", "tinytext", tmp_path / "y", _opts())
    # a store whose text tokens come from other weights: refused, never silently recomputed
    other = str(root / "other.zarr")

    vl_doubles.extract_other_text_weights(m, other)
    with pytest.raises(UserError, match="tinytext@layer.1/.*other weights"):
        feddra_run(root / "m.json", other, "tiny-staged", "tinytext", tmp_path / "z", _opts())
    with pytest.raises(UserError, match="tiny-staged@block/.*no such shard"):
        feddra_run(root / "m.json", store, "tiny-staged", "tinytext", tmp_path / "z", _opts(image_cut="block"))
    assert not any((tmp_path / d / "results.json").exists() for d in ("x", "y", "z"))


def test_cli_feddra(paired, tmp_path):
    from click.testing import CliRunner

    from fedheads.cli import main

    root, _, store = paired
    args = ["feddra", "--manifest", str(root / "m.json"), "--store", store, "--image-encoder", "tiny-staged",
            "--image-cut", "stem", "--text-encoder", "tinytext", "--rounds", "1", "--set", "steps=1",
            "--set", "batch_size=4", "--baseline", "no-dro", "--num-workers", "0", "--device", "cpu", "--quiet",
            "--out", str(tmp_path / "cli")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert r.output.startswith("no-dro: text->image R@1")
    res = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert res["config"]["dro"]["rho"] == 0.0 and res["config"]["mu"] == 5.0
    bad = CliRunner().invoke(main, args[:-1] + [str(tmp_path / "cli2"), "--set", "divergence=tv"])
    assert bad.exit_code == 2 and "divergence" in bad.output
    env = kill_helpers.subprocess_env()
    p = subprocess.run([sys.executable, "-m", "fedheads.cli", "feddra", "--manifest", str(root / "m.json"),
                        "--image-encoder", "digitnet-builtin", "--text-encoder", "no-such-encoder",
                        "--out", str(tmp_path / "x")], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "no-such-encoder" in p.stderr


def test_cli_preset_fills_only_what_the_user_did_not_give(paired, tmp_path, monkeypatch):
    from click.testing import CliRunner

    import fedheads.alignment.runner as runner
    from fedheads.cli import main

    root, _, store = paired
    seen = []
    monkeypatch.setattr(runner, "feddra_run", lambda *a: seen.append(a[-1]) or {"algorithms": {}})
    base = ["feddra", "--manifest", str(root / "m.json"), "--image-encoder", "tiny-staged", "--text-encoder",
            "tinytext", "--out", str(tmp_path / "p")]
    for extra in ([], ["--preset", "quick"], ["--preset", "quick", "--rounds", "7", "--set", "text_trainable=all"]):
        r = CliRunner().invoke(main, base + extra)
        assert r.exit_code == 0, r.output
    paper, quick, mixed = seen
    assert (paper.fd.rounds, paper.fd.steps, paper.fd.batch_size, paper.text_trainable) == (25, 50, 64, "all")
    assert (quick.fd.rounds, quick.fd.steps, quick.fd.batch_size, quick.text_trainable) == (4, 5, 32, "frozen")
    assert (mixed.fd.rounds, mixed.fd.steps, mixed.text_trainable) == (7, 5, "all")
    assert quick.fd.mu == paper.fd.mu and quick.fd.dro == paper.fd.dro  # the method itself is unchanged
