"""`fedheads summarize`: one table across train, compare and finetune run directories."""

from __future__ import annotations

import csv
import json
import os

import pytest
from click.testing import CliRunner

import fedheads
from fedheads.cli import main
from tests.test_api import _arrays


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sum")
    fedheads.train(_arrays(), "fedncm", rounds=1, seeds=[0, 1], out=root / "ncm")
    fedheads.compare(_arrays(), ["fedncm", "lp"], rounds=2, seeds=0, out=root / "cmp")
    ft = {"algorithm": "fedncm+ft", "method": "fedncm+ft", "backbone": "resnet20-cifar10", "rounds": 3,
          "seeds": [0], "accuracy": {"mean": 61.5, "std": None}, "accuracy_cell": "61.50(-)",
          "per_client": {"a": {"mean": 61.5, "std": None, "n_test": 4}}, "clients_without_test": []}
    (root / "ft").mkdir()
    (root / "ft" / "results.json").write_text(json.dumps(ft))  # a finetune results.json's fields (7)
    return root


def test_markdown_and_csv_rows(runs, tmp_path):
    args = ["summarize", str(runs / "ncm"), str(runs / "cmp"), str(runs / "ft")]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 2 + 4 and lines[0].startswith("| run | algorithm |")
    assert [ln.split("|")[2].strip() for ln in lines[2:]] == ["fedncm", "fedncm", "lp", "fedncm+ft"]
    saved = json.loads((runs / "ncm" / "results.json").read_text())
    assert saved["accuracy_cell"] in lines[2] and "resnet20-cifar10" in lines[5]
    res = CliRunner().invoke(main, args + ["--out", str(tmp_path / "t.csv")], catch_exceptions=False)
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [r["algorithm"] for r in rows] == ["fedncm", "fedncm", "lp", "fedncm+ft"]
    assert float(rows[0]["accuracy_mean"]) == pytest.approx(saved["accuracy"]["mean"])
    assert rows[3]["accuracy_std"] == "" and rows[1]["run"] == os.path.relpath(runs / "cmp", tmp_path)
    CliRunner().invoke(main, args + ["--out", str(tmp_path / "t.md")], catch_exceptions=False)
    assert (tmp_path / "t.md").read_text().splitlines()[0] == lines[0]


def test_bad_inputs_are_one_line(runs, tmp_path):
    for args in (["summarize", str(tmp_path / "missing")],
                 ["summarize", str(runs / "ncm"), "--out", str(tmp_path / "t.txt")]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert not (tmp_path / "t.txt").exists()


def test_a_written_table_names_runs_relative_to_itself(runs, tmp_path):
    """A table written to a file names each run relative to the file's folder, never by the
    absolute path it was given (a home directory would be in every report)."""
    out = runs / "tables" / "t.md"
    res = CliRunner().invoke(main, ["summarize", str(runs / "ncm"), str(runs / "cmp"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert str(runs) not in text and "| ../ncm | fedncm |" in text and "| ../cmp | lp |" in text
    assert "(n=1)" in text and "(0.00)" not in text.split("| ../cmp |", 1)[1]
