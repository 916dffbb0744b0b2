"""pipelines.cells.run_head: it hands the engine the store's order and lets it reorder (with every
client in every round the engine stacks them largest first, core/order.py: local steps then skip
the clients already done without reordering) and reports the per-client results of a run in the
store's order."""

from __future__ import annotations

import collections

import pytest
import torch
from fed_tiny import tiny_fed


@pytest.mark.parametrize("algorithm", ["fedavg", "pfedme"])
def test_run_head_trains_largest_first_and_reports_in_store_order(monkeypatch, algorithm) -> None:
    import fedheads.core.engine as engine
    import fedheads.run.load as fd
    import pipelines.cells as cells
    from fedheads.run.train import TrainOptions, build_algorithm

    data = tiny_fed(M=5, seed=2)
    assert list(data.n_train) != sorted(data.n_train, reverse=True), "the double must be out of size order"
    # the loader's contract (tests/test_largest_first.py): the store's order
    monkeypatch.setattr(fd, "load_fed_data", lambda *a, **k: data)
    monkeypatch.setattr(cells, "_DATA", collections.OrderedDict())
    trained: list[tuple[int, ...]] = []
    run, inner = engine.run, engine._run
    monkeypatch.setattr(engine, "_run", lambda alg, d, *a, **k: trained.append(d.n_train) or inner(alg, d, *a, **k))
    cfg = {"algorithm": algorithm, "seed": 1, "backbones": ["b"], "features": {"backbones": {"b": {"dim": data.dim}}},
           "settings": {"common": {}, "method": {}},
           "options": {"rounds": 3, "fraction": 1.0, "device": "cpu", "eval_every": 1}}
    out = cells.run_head(cfg, {"store": "unused"})
    assert trained == [tuple(sorted(data.n_train, reverse=True))]
    assert out["clients"] == list(data.client_names) and out["domains"] == list(data.domains)
    pc = out["seed_result"]["per_client"]
    assert list(pc) == [n for n in data.client_names if n in pc]
    assert list(out["seed_result"]["n_test"]) == list(data.client_names)
    # the same per-client accuracies as the engine on the store's order (up to the server's sum order)
    opts = TrainOptions(rounds=3, seeds=(1,), fraction=1.0, device="cpu", eval_every=1, progress=False)
    ref = run(build_algorithm(algorithm, opts)[0], data, 3, seed=1, fraction=1.0, eval_every=1, progress=False)
    want = {n: 100.0 * a for n, a in zip(data.client_names, ref.final_accuracy("main").tolist()) if a == a}
    assert pc.keys() == want.keys()
    torch.testing.assert_close(torch.tensor(list(pc.values())), torch.tensor(list(want.values())), rtol=0, atol=1e-4)
    # a sampled federation keeps the store's order (the seeded draw of participants is by position)
    trained.clear()
    monkeypatch.setattr(cells, "_DATA", collections.OrderedDict())
    cells.run_head({**cfg, "options": {**cfg["options"], "fraction": 0.6}}, {"store": "unused"})
    assert trained == [data.n_train]
