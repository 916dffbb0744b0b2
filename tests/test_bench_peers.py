"""benchmarks/bench_peers.py: every framework that imports here runs the same FedAvg (same
initial head, client lists, weighting, learning rate), so with one full-batch step per epoch
(batch >= every client's rows, where the order of the rows no longer matters) they end at the
same model up to float rounding; the peers that are not installed (BENCH_PEERS_SITE names their
folder) are skipped by the benchmark itself and listed with the reason."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_peers as bench  # noqa: E402
import peers_frameworks as pf  # noqa: E402

from fedheads.core import heads  # noqa: E402


def write_idx(path: Path, a: np.ndarray) -> None:
    raw = bytes([0, 0, 8, a.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in a.shape) + a.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


def test_fashion_mnist_reads_raw_and_gzipped_idx(tmp_path: Path) -> None:
    assert bench.fashion_mnist(tmp_path) is None  # absent: the caller falls back to synthetic features
    imgs = np.arange(3 * 28 * 28).reshape(3, 28, 28) % 256
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", imgs)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([1, 2, 9]))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", imgs[:2])
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([0, 5]))
    xtr, ytr, xte, yte = bench.fashion_mnist(tmp_path)
    assert xtr.shape == (3, 784) and xtr.dtype == np.float32 and xtr.max() == pytest.approx(255 / 255)
    assert np.allclose(xtr[1] * 255, imgs[1].reshape(-1)) and ytr.tolist() == [1, 2, 9] and yte.tolist() == [0, 5]


def test_store_features_pool_every_clients_rows(tmp_path: Path) -> None:
    from embedcache.store.importer import import_features

    rng = np.random.default_rng(0)
    want: dict[str, list] = {"train": [], "test": []}
    for c in ("a", "b"):
        for split, n in (("train", 5), ("test", 2)):
            x, y = rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, n)
            np.savez(tmp_path / "f.npz", features=x, labels=y)
            import_features(tmp_path / "s.zarr", tmp_path / "f.npz", backbone="bb", client=c, split=split,
                            classes=["x", "y", "z"])
            want[split].append((x, y))
    xtr, ytr, xte, yte = bench.store_features(str(tmp_path / "s.zarr"), "bb")
    assert xtr.shape == (10, 4) and xte.shape == (4, 4) and ytr.dtype == np.int64
    got = sorted(map(tuple, np.column_stack([xtr, ytr]).tolist()))
    assert got == sorted(map(tuple, np.vstack([np.column_stack([x, y]) for x, y in want["train"]]).tolist()))


@pytest.mark.parametrize("hidden", [0, 7])
def test_peer_head_is_fedheads_head(hidden: int) -> None:
    """The torch module every peer trains, loaded with fedheads' initial head, computes fedheads'
    logits, and its state converts back to the same parameters."""
    spec = heads.HeadSpec(5, hidden, 3, batch_norm=False, normalize=False)
    p, b = heads.init_global(spec, 4, "cpu")
    x = torch.randn(6, 5)
    z, _ = heads.embed(spec, {k: v[None] for k, v in p.items()}, {}, x[None], torch.ones(1, 6, dtype=torch.bool), False)
    ours = heads.classify({k: v[None] for k, v in p.items()}, z)[0]
    m = pf.Head(5, hidden, 3)
    m.load_state_dict(pf.to_torch({k: v.numpy() for k, v in p.items()}, hidden))
    assert torch.allclose(m(x), ours, atol=1e-6)
    back = pf.from_torch(m.state_dict(), hidden)
    assert back.keys() == p.keys() and all(np.array_equal(back[k], p[k].numpy()) for k in p)
    assert bench.accuracy(back, x, ours.argmax(1)) == 100.0


def test_schedule_is_the_engines_sampler() -> None:
    from fedheads.core.engine import select_participants

    s = bench.schedule(40, 4, 3, seed=2)
    assert s.shape == (3, 4) and all(s[r].tolist() == select_participants(40, 0.1, 2, r).tolist() for r in range(3))


@pytest.mark.slow  # five fresh interpreters: ~30 s on an idle 2-core machine, about a minute on a busy one
def test_frameworks_agree_on_one_full_batch_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quick skewed protocol (iNaturalist-shaped client sizes, weighted aggregation, an MLP
    head) with a batch larger than any client: every framework that ran ends at fedheads' model."""
    if not bench.data_dir("federation_shapes").is_dir():
        pytest.skip("needs ../shared/data/federation_shapes (or EMBEDCACHE_ASSETS)")
    out = tmp_path / "peers.json"
    res = bench.main(["--quick", "--protocols", "skewed", "--heads", "mlp", "--batch", "100000", "--no-profile",
                      "--threads", "1", "--out", str(out)])
    case = res["cases"]["skewed/mlp"]
    fws = case["frameworks"]
    assert {"fedheads", "fedheads-loop"} <= fws.keys()
    assert set(fws) | {fw for fw, s in res["peers"].items() if "missing" in s} == {*bench.FRAMEWORKS, *bench.UNRUNNABLE}
    for fw, o in fws.items():
        assert o["max_parameter_difference"] < 1e-4, fw
        assert o["agrees"] and o["accuracy_gap_points"] == pytest.approx(0.0, abs=0.05), fw
        assert sorted(map(int, o["accuracy_by_round"])) == case["federation"]["keep_rounds"]
        assert o["peak_rss_bytes"]["median"] > 0 and o["cpu_seconds"]["median"] > 0
    fed = case["federation"]
    assert fed["client_rows_max"] > 10 * fed["client_rows_min"] and fed["batch"] == fed["client_rows_max"]  # skewed
    assert case["bound"]["bound_seconds_per_round"] > 0 and case["fedheads_multiple_of_bound"] > 0
    d = json.loads(out.read_text())
    assert d["command"] and d["commit"] and "fedheads" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.shared
def test_fmnist_store_extracts_the_official_splits(tmp_path: Path, shared: Path, cifar_weights: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/fmnist_store.py: Fashion-MNIST's own train/test split as one client's splits,
    extracted by embedcache, and read back by bench_peers.store_features in the same order."""
    import fmnist_store

    monkeypatch.setenv("EMBEDCACHE_WEIGHTS", str(shared / "weights"))
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (7, 28, 28))
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", imgs[:5])
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.array([1, 2, 9, 0, 3]))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", imgs[5:])
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([4, 8]))
    store = fmnist_store.build(tmp_path, "resnet20-cifar10", tmp_path / "cache", None, limit=4)
    assert store.parent.name.endswith("-first4")
    xtr, ytr, xte, yte = bench.store_features(str(store), "resnet20-cifar10")
    assert xtr.shape == (4, 64) and ytr.tolist() == [1, 2, 9, 0] and yte.tolist() == [4, 8]
    assert np.isfinite(xtr).all() and xtr.std() > 0
    assert fmnist_store.build(tmp_path, "resnet20-cifar10", tmp_path / "cache", None, limit=4) == store  # cached


def test_rounds_override_per_protocol() -> None:
    names = list(bench.PROTOCOLS)
    assert bench.parse_rounds("", names) == {}
    assert bench.parse_rounds("7", names) == {n: 7 for n in names}
    assert bench.parse_rounds("crossdevice=30,skewed=20", names) == {"crossdevice": 30, "skewed": 20}
    for bad in ("crossdevic=3", "skewed=0", "skewed=x"):
        with pytest.raises(SystemExit, match="--rounds"):
            bench.parse_rounds(bad, names)


def test_a_peer_that_cannot_run_here_is_listed_with_its_reason() -> None:
    """BlazeFL needs a newer Python than the project's: listed as not run, with the one line saying why."""
    import os

    status = bench.peer_status(os.environ.copy())
    assert "missing" in status["blazefl"]
    if sys.version_info < (3, 12):
        assert "requires Python >= 3.12" in status["blazefl"]["missing"]
