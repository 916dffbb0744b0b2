"""The Flower commands where the optional extra is absent or another release: one `error:` line,
exit 2, nothing written (runs with or without flwr installed: its absence is simulated)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flower_helpers import write_store

BLOCK_FLWR = "import sys\nsys.modules['flwr'] = None  # import flwr -> ImportError, as without the extra\n"
FAKE_RELEASE = ("import importlib.metadata as md, sys, types\n"
                "sys.modules['flwr'] = types.ModuleType('flwr')\n"
                "md.version = lambda name: '1.99.0' if name == 'flwr' else md.version(name)\n")


def _cli(prelude: str, args: list[str]) -> subprocess.CompletedProcess:
    code = prelude + f"from fedheads.cli import main\nmain({args!r})\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return write_store(tmp_path_factory.mktemp("flcli"))


@pytest.mark.parametrize("prelude,needle", [(BLOCK_FLWR, "not installed; install the extra"),
                                            (FAKE_RELEASE, "flwr 1.99.0 is installed, fedheads.flower needs 1.41.0")])
def test_flower_commands_without_the_extra_are_one_line(store, tmp_path, prelude, needle):
    out = tmp_path / "run"
    commands = [
        ["simulate", "--store", str(store), "--algorithm", "fedncm", "--backbones", "synth", "--out", str(out)],
        ["serve", "--nodes", "2", "--algorithm", "fedncm", "--backbones", "synth", "--out", str(out), "--wait", "1"],
        ["join", "--superlink", "127.0.0.1:9", "--store", str(store)],
    ]
    for args in commands:
        r = _cli(prelude, args)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1, (args[0], r.stderr)
        assert lines[0].startswith("error: flower: ") and needle in lines[0], lines
        assert not out.exists()
