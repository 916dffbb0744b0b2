"""End-to-end `fedheads` CLI on a small imported store: run-directory contract, compare,
predictions equal to the trainer's evaluation and to a numpy brute force, one-line errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from embedcache.store.importer import import_features
from fedheads.cli import main

C, D = 4, 12
CLIENTS = ("c0", "c1", "c2")
RESULT_KEYS = {"algorithm", "backbones", "rounds", "seeds", "accuracy", "per_client", "fairness",
               "communication", "trainable_params_per_client", "paper_trainable_params_per_client", "history"}


def _write_store(root: Path, name: str = "st.zarr", nan_client: str | None = None,
                 dim_client: str | None = None, empty_client: str | None = None,
                 empty_test_client: str | None = None) -> Path:
    rng = np.random.default_rng(0)
    means = rng.normal(size=(C, D)) * 1.5
    store = root / name
    for ci, c in enumerate(CLIENTS):
        for split, n in (("train", 40), ("test", 30)):
            if c == "c1":  # c1 lacks class 3: normal (padding), not an error
                y = rng.integers(0, C - 1, n)
            else:
                y = rng.integers(0, C, n)
            x = (means[y] + rng.normal(size=(n, D)) + 0.4 * ci).astype(np.float32)
            if c == dim_client:
                x = x[:, : D - 2]
            if c == empty_client and split == "train":
                x, y = x[:0], y[:0]
            if empty_test_client in (c, "all") and split == "test":
                x, y = x[:0], y[:0]
            f = root / f"{name}-{c}-{split}.npz"
            np.savez(f, features=x, labels=y)
            import_features(store, f, backbone="synth", client=c, split=split, domain=f"dom{ci}",
                            classes=[f"k{i}" for i in range(C)])
            if c == nan_client and split == "test":
                import zarr
                arr = zarr.open_array(str(store / "synth" / c / split / "features"), mode="r+")
                bad = np.asarray(arr[:])
                bad[0, 0] = np.nan
                arr[:] = bad
    return store


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return _write_store(tmp_path_factory.mktemp("fh"))


def _invoke(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=False)


@pytest.fixture(scope="module")
def fedpcl_run(store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "fedpcl"
    r = _invoke(["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpcl",
                 "--rounds", "3", "--seeds", "0,1", "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_train_writes_the_run_directory(fedpcl_run: Path):
    res = json.loads((fedpcl_run / "results.json").read_text())
    assert RESULT_KEYS <= res.keys()
    assert res["seeds"] == [0, 1] and res["rounds"] == 3 and res["backbones"] == ["synth"]
    assert set(res["per_client"]) == set(CLIENTS)
    assert 0.0 <= res["accuracy"]["mean"] <= 100.0
    assert [h["round"] for h in res["history"]] == [1, 2, 3]
    assert {"average", "worst_10", "worst_20", "worst_40", "best_10", "variance"} <= res["fairness"].keys()
    comm = res["communication"]
    # FedPCL uploads one prototype set (C x 256) per client per round, plus counts/presence
    assert comm["paper_comm_params_per_client_per_round"] == C * 256
    assert comm["upload_params_per_client_per_round"] >= C * 256
    cfg = json.loads((fedpcl_run / "config.json").read_text())
    assert cfg["algorithm"] == "fedpcl" and cfg["algorithm_config"]["tau"] == 0.07
    rows = list(csv.DictReader((fedpcl_run / "metrics.csv").open()))
    assert {r["client"] for r in rows} == set(CLIENTS) and {r["seed"] for r in rows} == {"0", "1"}
    for f in ("summary.md", "accuracy_per_round.png", "per_client.png", "state/seed0.pt", "state/seed1.pt"):
        assert (fedpcl_run / f).is_file(), f
    # state files hold tensors only
    torch.load(fedpcl_run / "state" / "seed0.pt", weights_only=True)


def _read_predictions(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def _accuracy_by_client(rows: list[dict[str, str]]) -> dict[str, float]:
    out: dict[str, list[bool]] = {}
    for r in rows:
        out.setdefault(r["client"], []).append(r["label"] == r["prediction"])
    return {c: 100.0 * float(np.mean(v)) for c, v in out.items()}


def train_then_predict(tmp_path: Path, *train_args: str) -> dict[str, float]:
    """`fedheads train` on a fresh `_write_store` (backbone synth; `train_args`: the algorithm and its
    options), then `fedheads predict` of the saved run: asserts that each client's accuracy of the
    predictions is the trainer's (results.json) and returns them by client."""
    store, run, out = _write_store(tmp_path), tmp_path / "run", tmp_path / "pred.csv"
    r = _invoke(["train", "--store", str(store), "--backbones", "synth", "--quiet", "--out", str(run), *train_args])
    assert r.exit_code == 0, r.output
    r = _invoke(["predict", "--run", str(run), "--store", str(store), "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((run / "results.json").read_text())
    acc = _accuracy_by_client(_read_predictions(out))
    for c in CLIENTS:
        assert acc[c] == pytest.approx(res["per_client"][c]["mean"], abs=1e-6), c
    return acc


@pytest.mark.parametrize("algorithm", ["fedpcl", "fedncm", "fedproto", "fedavg"])
def test_predictions_equal_the_trainers_evaluation(store, tmp_path, algorithm):
    run = tmp_path / algorithm
    r = _invoke(["train", "--store", str(store), "--backbones", "synth", "--algorithm", algorithm,
                 "--rounds", "2", "--seeds", "3", "--quiet", "--out", str(run)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "pred.csv"
    r = _invoke(["predict", "--run", str(run), "--store", str(store), "--top-k", "2",
                 "--chunk-rows", "7", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = _read_predictions(out)
    assert len(rows) == 30 * len(CLIENTS)
    assert {"client", "sample_id", "label", "prediction", "score", "top2_label"} <= rows[0].keys()
    res = json.loads((run / "results.json").read_text())
    acc = _accuracy_by_client(rows)
    for c in CLIENTS:
        assert acc[c] == pytest.approx(res["per_client"][c]["mean"], abs=1e-6), c
    # c1 never saw class 3: FedPCL's local prototypes cannot predict it (FedNCM's global means can)
    if algorithm == "fedpcl":
        assert all(r["prediction"] != "3" for r in rows if r["client"] == "c1")


def test_fedncm_predictions_match_numpy_bruteforce(store, tmp_path):
    from embedcache.store.reader import load_split

    run = tmp_path / "ncm"
    assert _invoke(["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedncm",
                    "--rounds", "1", "--seeds", "0", "--quiet", "--out", str(run)]).exit_code == 0
    out = tmp_path / "ncm.csv"
    assert _invoke(["predict", "--run", str(run), "--store", str(store), "--out", str(out)]).exit_code == 0
    train, test = load_split(str(store), ["synth"], "train"), load_split(str(store), ["synth"], "test")
    x = np.concatenate([train[c].features for c in CLIENTS]).astype(np.float64)
    y = np.concatenate([train[c].labels for c in CLIENTS])
    means = np.stack([x[y == k].mean(0) for k in range(C)])
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    rows = _read_predictions(out)
    for c in CLIENTS:
        q = test[c].features.astype(np.float64)
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        expect = (q @ means.T).argmax(1)
        got = np.array([int(r["prediction"]) for r in rows if r["client"] == c])
        np.testing.assert_array_equal(got, expect)


def test_compare_writes_table_and_results(store, tmp_path):
    out = tmp_path / "cmp"
    r = _invoke(["compare", "--store", str(store), "--backbones", "synth", "--algorithms",
                 "fedpcl,fedncm,fedavg", "--rounds", "2", "--seeds", "0", "--quiet", "--lr", "0.01",
                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert set(res["algorithms"]) == {"fedpcl", "fedncm", "fedavg"}
    for name, one in res["algorithms"].items():
        assert RESULT_KEYS <= one.keys(), name
    md = (out / "summary.md").read_text()
    assert "| Method |" in md and "fedncm" in md
    assert res["algorithms"]["fedpcl"]["training_rounds"] == 1 and "fedpcl trains 1 of them" in md
    # --lr does not apply to FedNCM: recorded, not silently used
    assert "lr" in json.loads((out / "fedncm" / "config.json").read_text())["ignored_options"]
    for f in ("accuracy_per_round.png", "per_client.png"):
        assert (out / f).is_file()


def test_engines_agree_through_the_cli(store, tmp_path):
    accs = {}
    for engine in ("vectorized", "loop"):
        out = tmp_path / engine
        assert _invoke(["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpcl",
                        "--rounds", "2", "--seeds", "0", "--engine", engine, "--quiet",
                        "--out", str(out)]).exit_code == 0
        accs[engine] = json.loads((out / "results.json").read_text())["per_client"]
    for c in CLIENTS:
        assert accs["vectorized"][c]["mean"] == pytest.approx(accs["loop"][c]["mean"], abs=1e-6)


def _one_line_error(args: list[str], needle: str) -> None:
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert needle in lines[0], r.output


def test_bad_input_gives_one_line_errors(store, tmp_path):
    base = ["train", "--store", str(store), "--rounds", "1", "--seeds", "0", "--quiet", "--out", str(tmp_path / "x")]
    _one_line_error(base + ["--backbones", "nosuch", "--algorithm", "fedpcl"], "nosuch")
    _one_line_error(base + ["--backbones", "synth", "--algorithm", "fedfoo"], "fedfoo")
    _one_line_error(base + ["--backbones", "synth", "--algorithm", "fedncm", "--lr", "0.1"], "--lr")
    _one_line_error(["train", "--store", str(tmp_path / "missing.zarr"), "--backbones", "synth",
                     "--algorithm", "fedpcl", "--out", str(tmp_path / "y")], "missing.zarr")
    assert not (tmp_path / "x" / "results.json").exists()


def test_dimension_mismatch_is_refused_at_the_store(tmp_path):
    from embedcache.errors import UserError

    with pytest.raises(UserError, match="feature dim 10 differs"):
        _write_store(tmp_path, dim_client="c2")


def test_dimension_mismatch_across_clients_in_memory():
    from embedcache.errors import UserError
    from fedheads.run.load import from_arrays

    a = (np.zeros((3, 4)), np.zeros(3, int), np.zeros((2, 4)), np.zeros(2, int))
    b = (np.zeros((3, 5)), np.zeros(3, int), np.zeros((2, 5)), np.zeros(2, int))
    with pytest.raises(UserError, match="dimension"):
        from_arrays([a, b], num_classes=2)


@pytest.mark.parametrize("kind,needle", [("nan", "NaN"), ("empty", "no training samples")])
def test_bad_stores_give_one_line_errors(tmp_path, kind, needle):
    st = _write_store(tmp_path, nan_client="c2" if kind == "nan" else None,
                      empty_client="c2" if kind == "empty" else None)
    _one_line_error(["train", "--store", str(st), "--backbones", "synth", "--algorithm", "fedpcl",
                     "--rounds", "1", "--seeds", "0", "--quiet", "--out", str(tmp_path / "r")], needle)
    assert not (tmp_path / "r" / "results.json").exists()


def test_set_fields_scoped_to_one_algorithm(store, tmp_path):
    out = tmp_path / "cmp"
    r = _invoke(["compare", "--store", str(store), "--backbones", "synth", "--algorithms", "fedpcl,fedncm",
                 "--rounds", "1", "--seeds", "0", "--quiet", "--set", "variant=code",
                 "--set", "fedpcl.tau=0.5", "--out", str(out)])
    assert r.exit_code == 0, r.output
    pcl = json.loads((out / "fedpcl" / "config.json").read_text())
    assert pcl["algorithm_config"]["variant"] == "code" and pcl["algorithm_config"]["tau"] == 0.5
    assert "variant" in json.loads((out / "fedncm" / "config.json").read_text())["ignored_options"]
    _one_line_error(["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedpcl",
                     "--rounds", "1", "--seeds", "0", "--quiet", "--set", "fedpcl.nosuch=1",
                     "--out", str(tmp_path / "z")], "nosuch")


def test_fedheads_never_imports_backbone_or_cluster_libraries(store, tmp_path):
    """House style: fedheads reads the store through embedcache.store.reader only."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from fedheads.cli import main\n"
        f"r = CliRunner().invoke(main, ['train', '--store', {str(store)!r}, '--backbones', 'synth', "
        f"'--algorithm', 'fedpcl', '--rounds', '1', '--seeds', '0', '--quiet', '--out', {str(tmp_path / 'r')!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(main, ['predict', '--run', {str(tmp_path / 'r')!r}, '--store', {str(store)!r}, "
        f"'--quiet', '--out', {str(tmp_path / 'p.csv')!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('timm', 'torchvision', 'dask', 'distributed', 'flwr', 'embedcache.sources', "
        "'embedcache.backbones') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


@pytest.fixture(scope="module")
def store512(tmp_path_factory) -> Path:
    """Three '512-d backbones', 10 classes, 2 clients: the FedPCL Table 2 / Table 14 shapes."""
    root = tmp_path_factory.mktemp("s512")
    rng = np.random.default_rng(1)
    store = root / "s.zarr"
    for b in ("bb1", "bb2", "bb3"):
        for c in ("c0", "c1"):
            for split in ("train", "test"):
                y = np.arange(20) % 10
                f = root / f"{b}-{c}-{split}.npz"
                np.savez(f, features=rng.normal(size=(20, 512)).astype(np.float32), labels=y,
                         sample_ids=np.array([f"{c}/{split}/{i}" for i in range(20)]))
                import_features(store, f, backbone=b, client=c, split=split, classes=[str(k) for k in range(10)])
    return store


@pytest.mark.parametrize("backbones,fedavg,fedrep,trainable", [
    ("bb1", 133_632, 131_072, 133_632), ("bb1,bb2", 264_704, 262_144, 264_704), ("bb1,bb2,bb3", 395_776, 393_216, 395_776)])
def test_paper_counts_come_out_of_real_runs(store512, tmp_path, backbones, fedavg, fedrep, trainable):
    """FedPCL Table 2 (# of Comm Params) and Table 14 (trainable params), from runs on K x 512-d."""
    out = tmp_path / "cmp"
    r = _invoke(["compare", "--store", str(store512), "--backbones", backbones, "--algorithms",
                 "fedavg,fedrep,fedproto,fedpcl", "--rounds", "1", "--seeds", "0", "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())["algorithms"]
    paper = {k: v["communication"]["paper_comm_params_per_client_per_round"] for k, v in res.items()}
    assert paper == {"fedavg": fedavg, "fedrep": fedrep, "fedproto": 2_560, "fedpcl": 2_560}
    assert res["fedavg"]["paper_trainable_params_per_client"] == trainable
    # measured uploads: FedAvg sends its whole head (weights + biases + BN), FedPCL one prototype set
    k = len(backbones.split(","))
    assert res["fedavg"]["communication"]["upload_params_per_client_per_round"] >= fedavg
    assert res["fedavg"]["trainable_params_per_client"] == 512 * k * 256 + 256 + 2 * 256 + 256 * 10 + 10


def test_predict_refuses_features_of_another_store(store, fedpcl_run, tmp_path):
    other = tmp_path / "other.zarr"
    rng = np.random.default_rng(5)
    for c in CLIENTS:
        for split in ("train", "test"):
            f = tmp_path / f"o-{c}-{split}.npz"
            np.savez(f, features=rng.normal(size=(5, D)).astype(np.float32), labels=np.arange(5) % C)
            import_features(other, f, backbone="synth", client=c, split=split, classes=[f"k{i}" for i in range(C)])
    _one_line_error(["predict", "--run", str(fedpcl_run), "--store", str(other), "--out", str(tmp_path / "p.csv")],
                    "backbone synth: weights (sha256) differs")
    _one_line_error(["predict", "--run", str(fedpcl_run), "--store", str(store), "--top-k", "0",
                     "--out", str(tmp_path / "p.csv")], "--top-k")
    assert not (tmp_path / "p.csv").exists()


def test_rerun_into_a_run_directory_is_refused_without_overwrite(store, tmp_path):
    out = tmp_path / "r"
    base = ["train", "--store", str(store), "--backbones", "synth", "--rounds", "1", "--seeds", "0", "--quiet",
            "--out", str(out)]
    assert _invoke(base + ["--algorithm", "fedpcl"]).exit_code == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (out / "notes.txt").write_text("mine")
    _one_line_error(base + ["--algorithm", "fedncm"], f"{out} holds a fedpcl run (results.json, config.json, state/)")
    assert {p: p.read_bytes() for p in before} == before  # untouched
    # --overwrite with a bad option: refused before the old run is touched
    r = CliRunner().invoke(main, base + ["--algorithm", "fedpcl", "--set", "tau=abc", "--overwrite"])
    assert r.exit_code != 0 and "tau" in r.output
    assert {p: p.read_bytes() for p in before} == before
    # --overwrite: the old run's files go (seed 0's state too), unknown files stay
    seed1 = [a if a != "0" else "1" for a in base]  # --seeds 1
    assert _invoke(seed1 + ["--algorithm", "fedncm", "--overwrite"]).exit_code == 0
    assert json.loads((out / "results.json").read_text())["algorithm"] == "fedncm"
    assert sorted(p.name for p in (out / "state").iterdir()) == ["seed1.ckpt.pt", "seed1.pt"]  # its checkpoint kept
    assert (out / "notes.txt").read_text() == "mine"


def test_compare_refuses_a_run_in_a_sub_directory(store, tmp_path):
    out = tmp_path / "cmp"
    sub = ["train", "--store", str(store), "--backbones", "synth", "--rounds", "1", "--seeds", "0", "--quiet"]
    assert _invoke(sub + ["--algorithm", "fedavg", "--out", str(out / "fedavg")]).exit_code == 0
    base = ["compare", "--store", str(store), "--backbones", "synth", "--algorithms", "fedncm,fedavg", "--rounds",
            "1", "--seeds", "0", "--quiet", "--out", str(out)]
    _one_line_error(base, f"{out / 'fedavg'} holds a fedavg run")
    assert not (out / "fedncm").exists() and not (out / "results.json").exists()
    assert _invoke(base + ["--overwrite"]).exit_code == 0
    assert set(json.loads((out / "results.json").read_text())["algorithms"]) == {"fedncm", "fedavg"}
    # a comparison is refused as a whole, and named as one
    _one_line_error(base, f"{out} holds a comparison of fedavg, fedncm (results.json)")
    _one_line_error(sub + ["--algorithm", "fedpcl", "--out", str(out)], "holds a comparison")
    # overwriting it with a train run also clears the comparison's sub-directories
    assert _invoke(sub + ["--algorithm", "fedpcl", "--overwrite", "--out", str(out)]).exit_code == 0
    assert not (out / "fedavg" / "results.json").exists() and not (out / "fedncm" / "state").exists()


def test_out_that_is_a_file_or_empty_dir(store, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    base = ["train", "--store", str(store), "--backbones", "synth", "--algorithm", "fedncm", "--rounds", "1",
            "--seeds", "0", "--quiet"]
    _one_line_error(base + ["--out", str(f)], "is a file")
    _one_line_error(base + ["--overwrite", "--out", str(f)], "is a file")
    (tmp_path / "empty").mkdir()
    assert _invoke(base + ["--out", str(tmp_path / "empty")]).exit_code == 0


def test_a_client_without_test_samples_stays_visible(tmp_path):
    st = _write_store(tmp_path, empty_test_client="c2")
    out = tmp_path / "cmp"
    r = _invoke(["compare", "--store", str(st), "--backbones", "synth", "--algorithms", "fedpcl,fedncm",
                 "--rounds", "2", "--seeds", "0,1", "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())["algorithms"]
    for name, one in res.items():
        assert one["per_client"]["c2"] == {"mean": None, "std": None, "n_test": 0}, name
        assert one["per_client"]["c0"]["n_test"] == 30 and one["clients_without_test"] == ["c2"]
        # aggregates are over the clients that have test samples
        assert one["accuracy"]["mean"] == pytest.approx(
            np.mean([one["per_client"][c]["mean"] for c in ("c0", "c1")]), abs=1e-9)
    note = "n/a (0 test): c2 has no test samples; Avg and fairness are over the 2 clients with test samples."
    for md in (r.output, (out / "summary.md").read_text(), (out / "fedpcl" / "summary.md").read_text()):
        assert "| n/a (0 test) |" in md and md.count(note) == 1, md
    assert {row["client"] for row in csv.DictReader((out / "fedpcl" / "metrics.csv").open())} == set(CLIENTS)


def test_no_client_with_test_samples_fails_before_training(tmp_path):
    st = _write_store(tmp_path, empty_test_client="all")
    for cmd in (["train", "--algorithm", "fedpcl"], ["compare", "--algorithms", "fedpcl,fedncm"]):
        _one_line_error(cmd + ["--store", str(st), "--backbones", "synth", "--rounds", "1", "--seeds", "0",
                               "--quiet", "--out", str(tmp_path / "r")],
                        "no client has test samples (e.g. c0: 0); re-partition with fewer --train-per-class")
        assert not (tmp_path / "r").exists()


def test_fedncm_trains_the_one_round_it_needs_in_a_longer_comparison(store, tmp_path):
    """FedNCM is one pass (Alg. 1): with every client taking part, rounds after the first send
    only zeros. A comparison at --rounds 4 trains it for 1 round, with the accuracy 4 rounds give,
    and says so; the other algorithms keep their 4 rounds; partial participation keeps them all."""
    out = tmp_path / "cmp"
    r = _invoke(["compare", "--store", str(store), "--backbones", "synth", "--algorithms", "fedncm,fedavg",
                 "--rounds", "4", "--seeds", "0,1", "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())["algorithms"]
    ncm, avg = res["fedncm"], res["fedavg"]
    assert ncm["rounds"] == 4 and ncm["training_rounds"] == 1 and [h["round"] for h in ncm["history"]] == [1]
    assert avg["training_rounds"] == 4 and len(avg["history"]) == 4
    assert "fedncm trains 1 of them (one pass" in (out / "summary.md").read_text()
    assert {row["round"] for row in csv.DictReader((out / "fedncm" / "metrics.csv").open())} == {"1"}
    import fedheads

    one = fedheads.train(store, "fedncm", backbones="synth", rounds=1, seeds=[0, 1])
    assert ncm["per_client"] == one.per_client and ncm["accuracy"] == one.accuracy
    part = fedheads.train(store, "fedncm", backbones="synth", rounds=4, seeds=0, fraction=0.5)
    assert part.training_rounds == 4  # a client may first take part in any round
