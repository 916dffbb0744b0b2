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
                "_version = md.version  # the real one, for every other package\n"
                "md.version = lambda name: '1.99.0' if name == 'flwr' else _version(name)\n")


def _cli(prelude: str, args: list[str]) -> subprocess.CompletedProcess:
    code = prelude + f"from fedheads.cli import main\nmain({args!r})\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


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


def test_a_node_keeps_its_runtime_api_on_loopback_and_flower_offline(tmp_path):
    """Only the SuperLink address is remote: the SuperNode's own API binds 127.0.0.1, its node
    config carries the node's data, and its environment turns Flower's network switches off."""
    from flower_helpers import FLOWER_MISSING

    pytest.importorskip("flwr", reason=FLOWER_MISSING)
    from fedheads.flower import QUIET_ENV
    from fedheads.flower.deploy import join_command

    cmd, env = join_command("10.0.0.5:9092", {"store": "/data/s.zarr", "client": "c1", "manifest": ""}, tmp_path)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--superlink") + 1] == "10.0.0.5:9092"
    assert cmd[cmd.index("--node-config") + 1] == 'store="/data/s.zarr" client="c1"'
    assert all(env[k] == v for k, v in QUIET_ENV.items()) and env["FLWR_HOME"] == str(tmp_path)


def test_simulate_command_writes_the_run_and_refuses_bad_input_in_one_line(store, tmp_path):
    from flower_helpers import FLOWER_MISSING

    pytest.importorskip("flwr", reason=FLOWER_MISSING)
    from click.testing import CliRunner

    from fedheads.cli import main

    out = tmp_path / "sim"
    base = ["simulate", "--store", str(store), "--algorithm", "fedncm", "--backbones", "synth", "--timeout", "120"]
    r = CliRunner().invoke(main, base + ["--set", "fedncm.rule=sqeuclidean", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = __import__("json").loads((out / "results.json").read_text())
    assert res["engine"] == "flower" and len(res["flower"]["rounds"]) == 1
    assert __import__("json").loads((out / "config.json").read_text())["algorithm_config"]["rule"] == "sqeuclidean"
    assert "over Flower (flower)" in r.output
    for args, needle in ((["--out", str(out)], str(out)), (["--set", "fedncm.nosuch=1", "--out", str(tmp_path / "b")],
                                                          "nosuch"),
                         (["--on-dropout", "continue", "--secagg", "--clients", "c0,c9", "--out", str(tmp_path / "c")],
                          "c9 not in")):
        r = CliRunner().invoke(main, base + args)
        lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.output


def test_join_with_an_unwritable_log_is_one_line(store, tmp_path):
    pytest.importorskip("flwr")
    r = _cli("", ["join", "--superlink", "127.0.0.1:9", "--store", str(store), "--log", str(tmp_path)])
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip() and not ln.startswith("joining ")]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: --log {tmp_path}: cannot write it"), r.stderr
