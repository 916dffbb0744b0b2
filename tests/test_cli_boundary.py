"""The exception boundary both CLIs share (embedcache/cli_base.py): UserError -> one line, exit
2; Ctrl-C -> one line, exit 130; anything else -> one `internal error` line, exit 1, or
Python's traceback with FEDFROZEN_DEBUG=1."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from store_doubles import assert_one_line

from embedcache.cli import main as ec
from embedcache.errors import UserError
from fedheads.cli import main as fh


@pytest.mark.parametrize("cli,cmd,target", [
    (ec, ["inspect", "S"], "embedcache.store.maintenance.inspect_store"),
    (fh, ["train", "--store", "S", "--backbones", "bb", "--algorithm", "fedncm", "--out", "O"], "fedheads.run.train.train_run"),
])
def test_an_unexpected_exception_is_one_line_unless_debugging(tmp_path, monkeypatch, cli, cmd, target):
    module, name = target.rsplit(".", 1)

    def boom(*a, **k):
        raise ValueError("zarr said\nsomething odd")
    monkeypatch.setattr(f"{module}.{name}", boom)
    monkeypatch.setattr("fedheads.cli.store_with", lambda *a, **k: None)  # no store is read before the target
    args = [str(tmp_path / "s") if a == "S" else str(tmp_path / "o") if a == "O" else a for a in cmd]
    monkeypatch.delenv("FEDFROZEN_DEBUG", raising=False)
    res = CliRunner().invoke(cli, args)
    assert_one_line(res, 1, "error: internal error: ValueError: zarr said something odd", "FEDFROZEN_DEBUG=1")
    monkeypatch.setenv("FEDFROZEN_DEBUG", "1")
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1 and isinstance(res.exception, ValueError)  # the traceback is Python's own
    monkeypatch.setattr(f"{module}.{name}", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert_one_line(CliRunner().invoke(cli, args), 130, "error: interrupted")
    monkeypatch.setattr(f"{module}.{name}", lambda *a, **k: (_ for _ in ()).throw(UserError("item: bad")))
    assert_one_line(CliRunner().invoke(cli, args), 2, "error: item: bad")
    res = CliRunner().invoke(cli, [cmd[0], "--no-such-option"])
    # a misspelt option: one line naming it (fedheads' declared commands), or click's own usage error
    assert res.exit_code == 2 and ("No such option" in res.output or "no option --no-such-option" in res.output)
