"""A run opens its feature store once and passes the opened store down (the backbone check, the
feature dimensions, the load, the dataset name and the fingerprint in config.json all read the
same StoreInfo): counted at embedcache's opener, at the read of the root's metadata (with the
consolidated metadata: the store's whole description) and at zarr's group opener (the reads do
not need zarr groups; at most one is opened)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import embedcache.store.reader as reader
from embedcache.store.importer import import_features


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("once")
    rng = np.random.default_rng(1)
    store = root / "s.zarr"
    for c, n in (("a", 9), ("b", 4), ("c", 7)):
        for split, m in (("train", n), ("test", 3)):
            f = root / f"{c}-{split}.npz"
            np.savez(f, features=rng.normal(size=(m, 5)).astype("f4"), labels=rng.integers(0, 2, m))
            import_features(store, f, backbone="bb", client=c, split=split, domain=f"d{c}", classes=["x", "y"])
    return store


@pytest.fixture
def opens(monkeypatch) -> dict[str, int]:
    import embedcache.store.layout as layout

    n = {"open_store": 0, "metadata": 0, "zarr": 0}
    real_open, real_meta, real_root = reader.open_store, reader.root_metadata, layout.zarr_root

    def open_store(*a, **k):
        n["open_store"] += 1
        return real_open(*a, **k)

    def root_metadata(*a, **k):
        n["metadata"] += 1
        return real_meta(*a, **k)

    def zarr_root(*a, **k):
        n["zarr"] += 1
        return real_root(*a, **k)

    monkeypatch.setattr(reader, "open_store", open_store)
    monkeypatch.setattr(reader, "root_metadata", root_metadata)
    monkeypatch.setattr(layout, "zarr_root", zarr_root)
    return n


def _once(opens: dict[str, int]) -> bool:
    return opens["open_store"] == opens["metadata"] == 1 and opens["zarr"] <= 1


@pytest.mark.parametrize("command", ["train", "compare"])
def test_the_fedheads_command_opens_the_store_once(store, tmp_path, opens, command) -> None:
    from fedheads.cli import main

    which = ["--algorithm", "fedavg"] if command == "train" else ["--algorithms", "fedavg,fedproto"]
    res = CliRunner().invoke(main, [command, "--store", str(store), "--backbones", "bb", *which, "--rounds", "1",
                                    "--seeds", "0,1", "--device", "cpu", "--quiet", "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert _once(opens), opens
    # what the run read from the store is all there
    cfg = json.loads(((tmp_path / "run" / ("" if command == "train" else "fedavg")) / "config.json").read_text())
    assert cfg["store"] == str(store) and cfg["store_fingerprint"]["backbones"]["bb"]["dim"] == 5
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["dataset"] == reader.open_store(store).source != ""


@pytest.mark.parametrize("written", [False, True])
def test_the_python_api_opens_the_store_once(store, tmp_path, opens, written) -> None:
    import fedheads

    res = fedheads.train(str(store), "fedavg", backbones="bb", rounds=1, seeds=(0, 1), device="cpu",
                         out=tmp_path / "run" if written else None)
    assert _once(opens), opens
    assert res.clients == ["a", "b", "c"]


def test_a_store_opened_by_the_caller_is_not_opened_again(store, tmp_path, opens) -> None:
    from fedheads.run.train import TrainOptions, compare_runs

    info = reader.open_store(store)
    opts = TrainOptions(rounds=1, seeds=(0,), device="cpu", progress=False)
    compare_runs(info, ["bb"], ["fedncm", "fedavg"], opts, tmp_path / "cmp")
    assert _once(opens), opens


def test_predict_on_a_store_opens_it_once(store, tmp_path, monkeypatch) -> None:
    import fedheads

    fedheads.train(str(store), "fedncm", backbones="bb", rounds=1, seeds=0, device="cpu", out=tmp_path / "run")
    n = {"open_store": 0}
    real = reader.open_store
    monkeypatch.setattr(reader, "open_store", lambda *a, **k: n.__setitem__("open_store", n["open_store"] + 1)
                        or real(*a, **k))
    table = fedheads.predict(tmp_path / "run", str(store))
    assert n == {"open_store": 1} and len(table["client"]) == 9
