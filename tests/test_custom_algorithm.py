"""docs/custom_algorithm.md: its algorithm, registered from user code, runs in both engines and
solves the pooled ridge regression exactly (numpy reference)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fedheads.algorithms import _REGISTRY
from tests.test_api import _arrays

DOC = Path(__file__).resolve().parents[1] / "docs" / "custom_algorithm.md"


@pytest.fixture
def ridge():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 2, "docs/custom_algorithm.md: expected the algorithm and its use"
    yield blocks
    _REGISTRY.pop("ridge", None)  # the registry is process-wide: leave it as it was


def test_documented_algorithm_runs_in_both_engines(ridge, capsys):
    scope: dict = {"clients": _arrays(seed=3)}
    exec(compile(ridge[0], str(DOC), "exec"), scope)
    exec(compile(ridge[1], str(DOC), "exec"), scope)
    fast, slow = scope["fast"], scope["slow"]
    assert fast.engine == "vectorized" and slow.engine == "loop"
    for c in fast.per_client:
        assert fast.per_client[c]["mean"] == pytest.approx(slow.per_client[c]["mean"], abs=1e-9)
    w_fast, w_slow = fast.states[0].server_state.weight, slow.states[0].server_state.weight
    np.testing.assert_allclose(w_fast.numpy(), w_slow.numpy(), rtol=1e-9, atol=1e-12)
    # the federated solution is the centralised ridge regression of the pooled training data
    x = np.concatenate([c[0] for c in scope["clients"].values()]).astype(np.float64)
    y = np.eye(3)[np.concatenate([c[1] for c in scope["clients"].values()])]
    ref = np.linalg.solve(x.T @ x + 0.1 * np.eye(x.shape[1]), x.T @ y)
    np.testing.assert_allclose(w_fast.numpy(), ref, rtol=1e-9, atol=1e-12)
    assert fast.accuracy["mean"] > 80  # separable toy clusters
    assert capsys.readouterr().out.strip() == f"{fast.accuracy_cell} {slow.accuracy_cell}"
