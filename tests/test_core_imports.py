"""fedheads/core is the algorithm core every driver shares: it imports only torch, itself, the
error type (embedcache.errors) and harmless standard-library modules, so a networked or embedded
driver can run it without the command line's dependencies (a progress bar is the caller's hook)."""

from __future__ import annotations

import ast
import io
from pathlib import Path

from fed_tiny import tiny_fed

import fedheads.core
from fedheads.algorithms.fedncm import FedNCM
from fedheads.core.engine import run
from fedheads.run.progress import RoundBar
from fedheads.run.train import TrainOptions, train_data

CORE = Path(fedheads.core.__file__).parent
# standard-library modules judged harmless: no I/O, terminals, processes or network
STDLIB = {"__future__", "collections.abc", "contextlib", "dataclasses", "enum", "functools", "hashlib", "importlib",
          "itertools", "math", "threading", "time", "typing"}


def _allowed(module: str) -> bool:
    return (module in STDLIB or module == "torch" or module.startswith("torch.") or module == "embedcache.errors"
            or module == "fedheads.core" or module.startswith("fedheads.core."))


def test_core_imports_only_torch_itself_and_the_error_type():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["fedheads.core" if node.level else node.module or ""]  # relative: the package itself
            else:
                continue
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names if not _allowed(n)]
    assert not bad, "\n".join(bad)


def test_the_engine_reports_every_round_to_its_progress_hook():
    calls = []
    res = run(FedNCM(), tiny_fed(), rounds=3, eval_every=2, progress=lambda *a: calls.append(a))
    assert [(d, t) for d, t, _ in calls] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert calls[0][2] is None and [c[2] for c in calls[1:]] == res.history


def test_the_round_bar_draws_rounds_and_accuracy():
    out = io.StringIO()
    with RoundBar("fedncm[vectorized]", file=out) as bar:
        run(FedNCM(), tiny_fed(), rounds=2, progress=bar)
        assert (bar.bar.n, bar.bar.total) == (2, 2) and bar.bar.postfix.startswith("acc=")
    assert "fedncm[vectorized]" in out.getvalue()
    quiet = io.StringIO()
    with RoundBar("x", enabled=False, file=quiet) as bar:
        run(FedNCM(), tiny_fed(), rounds=1, progress=bar)
    assert quiet.getvalue() == ""


def test_training_draws_the_bar_unless_quiet(capsys):
    train_data(tiny_fed(), ["f"], "fedavg", TrainOptions(rounds=2, seeds=(0,), device="cpu"))
    assert "fedavg[vectorized]" in capsys.readouterr().err
    train_data(tiny_fed(), ["f"], "fedavg", TrainOptions(rounds=2, seeds=(0,), device="cpu", progress=False))
    assert "fedavg[vectorized]" not in capsys.readouterr().err
