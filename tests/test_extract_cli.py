"""`embedcache extract` command line: bad input is one line and exit 2."""

from __future__ import annotations

from click.testing import CliRunner

from embedcache.cli import main


def test_missing_manifest_is_one_line_exit_2(tmp_path):
    res = CliRunner().invoke(main, ["extract", "--manifest", str(tmp_path / "nope.json"), "--backbones", "x",
                                    "--store", str(tmp_path / "s")])
    assert res.exit_code == 2 and res.output.strip() == f"error: {tmp_path / 'nope.json'}: manifest file not found"
    assert not (tmp_path / "s").exists()


def test_bad_scheduler_and_plugin(tmp_path):
    m = tmp_path / "m.json"
    m.write_text("{}")
    res = CliRunner().invoke(main, ["extract", "--manifest", str(m), "--backbones", "x", "--store", str(tmp_path / "s"),
                                    "--plugin", "no_such_module_xyz"])
    assert res.exit_code == 2 and "plugin no_such_module_xyz: cannot import" in res.output
