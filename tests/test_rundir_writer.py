"""fedheads.run.rundir.RunDir, the one writer of run directories: results.json comes last (a run
that dies before `finish` leaves none, and nothing is written after it), every file is atomic (a
write that fails leaves the old file and no temporary), and opening refuses and clears as the
commands always did (only the names a run writes are removed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embedcache.errors import UserError
from fedheads.run.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def test_files_and_their_bytes(tmp_path):
    rd = RunDir(tmp_path / "run").begin(overwrite=False)
    rd.write_json("config.json", {"b": 1, "a": [1, 2]})
    rd.write_csv("metrics.csv", ["round", "acc"], [[1, 50.0], [2, ""]])
    rd.write_text("summary.md", "# x\n")
    rd.save_state("state/seed0.pt", {"w": torch.arange(3)})
    rd.finish({"z": 1, "a": {"c": 2, "b": 3}})
    d = tmp_path / "run"
    assert (d / "config.json").read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    assert (d / "metrics.csv").read_text() == "round,acc\n1,50.0\n2,\n"
    assert (d / "results.json").read_text() == json.dumps({"z": 1, "a": {"c": 2, "b": 3}}, indent=2, sort_keys=True)
    assert torch.equal(torch.load(d / "state" / "seed0.pt", weights_only=True)["w"], torch.arange(3))
    assert _files(d) == {"config.json", "metrics.csv", "summary.md", "state/seed0.pt", "results.json"}
    assert oct((d / "results.json").stat().st_mode & 0o777) == "0o644"


def test_nothing_is_written_after_results_json(tmp_path):
    rd = RunDir(tmp_path)
    rd.finish({"a": 1})
    for write in (lambda: rd.write_text("summary.md", "x"), lambda: rd.write_json("config.json", {}),
                  lambda: rd.save_state("state/s.pt", {}), lambda: rd.finish({"a": 2}),
                  lambda: rd.save_figure("p.png", lambda p: p.write_bytes(b"png"))):
        with pytest.raises(RuntimeError, match="after results.json"):
            write()
    assert _files(tmp_path) == {"results.json"}
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": 1}


def test_a_run_killed_before_finish_leaves_no_results_json(tmp_path):
    """A resumed run into a finished directory: `begin` removes the old results.json, the run dies
    after writing config.json (a hard kill, no cleanup), and the directory does not look complete."""
    out = tmp_path / "run"
    RunDir(out).begin(False).finish({"old": True})
    script = (f"import os\nfrom fedheads.run.rundir import RunDir\nrd = RunDir({str(out)!r}).begin(False)\n"
              "rd.write_json('config.json', {'a': 1})\nos._exit(9)\nrd.finish({'new': True})\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={"PYTHONPATH": str(REPO)})
    assert res.returncode == 9
    assert _files(out) == {"config.json"}


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    rd = RunDir(tmp_path)
    rd.save_state("state/seed0.pt", {"w": torch.ones(2)})
    rd.save_figure("plot.png", lambda p: p.write_bytes(b"old"))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        rd.save_state("state/seed0.pt", {"w": torch.zeros(2), "x": Unpicklable()})

    def half_drawn(path: Path) -> None:  # a plot that dies while saving, as plotting.save writes
        from embedcache.atomic import atomic_path

        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half")
            raise ValueError("drawing failed")

    with pytest.raises(ValueError, match="drawing failed"):
        rd.save_figure("plot.png", half_drawn)
    assert torch.equal(torch.load(tmp_path / "state" / "seed0.pt", weights_only=True)["w"], torch.ones(2))
    assert (tmp_path / "plot.png").read_bytes() == b"old"
    assert _files(tmp_path) == {"state/seed0.pt", "plot.png"}  # no .tmp left


def test_check_refuses_as_train_and_as_finetune(tmp_path):
    out = tmp_path / "run"
    RunDir(out).begin(False).finish({"algorithm": "fedavg"})
    with pytest.raises(UserError, match=r"holds a fedavg run \(results.json\); use --overwrite or another --out$"):
        RunDir(out).check(overwrite=False, resume=False)
    with pytest.raises(UserError, match="without checkpoints: nothing to resume"):
        RunDir(out).check(overwrite=False, resume=True)
    with pytest.raises(UserError, match="give one"):
        RunDir(out).check(overwrite=True, resume=True)
    with pytest.raises(UserError, match="holds a fedavg run .*; use --resume to continue it, --overwrite to replace it"):
        RunDir(out).check(overwrite=False, resume=False, resume_needs_checkpoints=False)
    RunDir(out).check(overwrite=False, resume=True, resume_needs_checkpoints=False)  # finetune: resume goes on
    RunDir(out).check(overwrite=True, resume=True, resume_needs_checkpoints=False)
    RunDir(tmp_path / "empty").check(overwrite=False, resume=False)
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory"):
        RunDir(tmp_path / "f").check(overwrite=True, resume=False, resume_needs_checkpoints=False)


def test_a_comparison_member_is_refused_and_overwrite_removes_only_run_files(tmp_path):
    out = tmp_path / "cmp"
    rd = RunDir(out, ["a", "b"])
    for m in ("a", "b"):
        rd.member(m).begin(False).finish({"algorithm": m})
    rd.write_text("notes.txt", "mine")
    rd.write_text("b/mine.txt", "mine")
    with pytest.raises(UserError, match=r"cmp/a holds an? a run"):
        RunDir(out, ["a", "b"]).check(overwrite=False, resume=False)
    RunDir(out, ["a", "b"]).begin(overwrite=True)
    assert _files(out) == {"notes.txt", "b/mine.txt"}
    # without --overwrite (a resume): only results.json goes, the rest stays for the run to continue
    rd = RunDir(out, ["a"])
    rd.member("a").write_json("config.json", {})
    rd.member("a").finish({})
    RunDir(out, ["a"]).begin(overwrite=False)
    assert _files(out) == {"notes.txt", "b/mine.txt", "a/config.json"}
