"""Every committed benchmark figure says which command and commit made it, and that command is a
committed script that benchmarks/run_all.sh (or the GPU check) runs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = sorted((BENCH / "results").glob("*.json"))
RUNNERS = "\n".join((BENCH / f).read_text() for f in ("run_all.sh", "gpu_check.sh"))


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_result_names_its_command_commit_and_script(path):
    d = json.loads(path.read_text())
    assert d.get("command") and d.get("commit"), f"{path.name}: no command or commit recorded"
    scripts = re.findall(r"benchmarks/([\w]+)\.(?:py|sh)", d["command"]) or re.findall(r"\b(\w+)\.(?:py|sh)\b", d["command"])
    assert scripts, f"{path.name}: its command names no benchmark script: {d['command']!r}"
    script = scripts[0]
    assert (BENCH / f"{script}.py").is_file() or (BENCH / f"{script}.sh").is_file(), f"{path.name}: {script} missing"
    assert script in RUNNERS or script == "bench_engine_ab", f"{path.name}: {script} is not run by run_all.sh"


def test_write_json_records_command_and_commit(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [str(BENCH / "bench_x.py"), "--flag", "a b"])
    from machine_info import write_json

    write_json({"figure": 1.0}, tmp_path / "x.json")
    d = json.loads((tmp_path / "x.json").read_text())
    assert d["command"].endswith("benchmarks/bench_x.py --flag 'a b'") and d["figure"] == 1.0
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?|unknown", d["commit"])
    monkeypatch.setattr(sys, "argv", [str(BENCH / "bench_x.py"), "--store", str(Path.home() / ".cache" / "s")])
    write_json({}, tmp_path / "h.json")  # a path under the home directory is written with ~
    assert json.loads((tmp_path / "h.json").read_text())["command"].endswith("bench_x.py --store ~/.cache/s")
    inner = f"/tmp/x{Path.home()}/y"  # the home's name inside another path is left alone
    monkeypatch.setattr(sys, "argv", [str(BENCH / "bench_x.py"), f"--data={inner}"])
    write_json({}, tmp_path / "i.json")
    assert json.loads((tmp_path / "i.json").read_text())["command"].endswith(f"bench_x.py --data={inner}")
    write_json({"command": "mine", "commit": "abc"}, tmp_path / "y.json")  # a benchmark's own wins
    assert json.loads((tmp_path / "y.json").read_text())["command"] == "mine"


def test_benchmarks_page_lists_every_result_with_its_command():
    page = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    for path in RESULTS:
        assert f"`{json.loads(path.read_text())['command']}`" in page, f"docs/benchmarks.md: {path.name} missing"
