"""The main job's own output (pipelines.quickstart), with the CLIs it runs replaced by a recorder:
every echoed command is what a user would paste (console scripts, quoted, the same arguments the
job runs) and the job itself prints no table (`fedheads compare` prints it, once)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from pipelines import quickstart


def test_echoed_commands_paste_and_tables_are_printed_once(tmp_path, monkeypatch):
    ran: list[list[str]] = []

    def fake_run(cmd, *a, **k):
        assert cmd[:2] == [sys.executable, "-m"]
        ran.append(cmd[2:])
        if cmd[2:4] == ["fedheads.cli", "compare"]:
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "results.json").write_text(json.dumps({"algorithms": {"fedpcl": {}, "fedncm": {}}}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(quickstart.subprocess, "run", fake_run)
    out = tmp_path / "my runs"  # a space: the echoed command must quote it
    res = CliRunner().invoke(quickstart.main, ["--out", str(out), "--backbones", "digitnet-builtin",
                                                "--rounds", "2", "--seeds", "0", "--ft-rounds", "1"])
    assert res.exit_code == 0, res.output
    echoed = [ln[2:] for ln in res.output.splitlines() if ln.startswith("$ ")]
    assert len(echoed) == len(ran) == 5  # partition, extract, compare, extract --cut, finetune
    for line, cmd in zip(echoed, ran):
        words = shlex.split(line)
        # the console script of the venv running the job, by path: it runs pasted without activating
        # the venv (the README never says to); the same file a bare `fedheads` finds once activated
        assert Path(words[0]).name in ("embedcache", "fedheads") and ".cli" not in line
        assert os.path.samefile(words[0], Path(sys.executable).parent / Path(words[0]).name)
        assert words[1:] == cmd[1:]  # the echoed command is exactly the one run
    assert "|" not in res.output  # no table of its own: compare's table is the only one
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("done in") and str(out / "compare" / "summary.md") in last \
        and str(out / "finetune" / "summary.md") in last
