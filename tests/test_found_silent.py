"""Silent wrong results refused or stated: FedPFT with classes too small to fit (fewer components,
a note for classes no client sent, a refusal when nothing was sent), CCVR calibrating a saved
head of other classes or features, and a pipeline --backbone mapping to an unknown backbone."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from sklearn.mixture import GaussianMixture
from store_doubles import assert_one_line

from embedcache.errors import UserError
from embedcache.store.importer import import_features
from fedheads.algorithms.fedpft import FedPFTConfig, fit_mixtures, gmm_seed
from fedheads.cli import main

CENTRES = np.array([[6.0, 0, 0, 0], [0, 6.0, 0, 0], [0, 0, 6.0, 0]], dtype=np.float32)


def _store(root, name: str, classes, train_per_class, test_per_class: int = 4, clients: int = 4, seed: int = 0):
    """Clients of three well-separated classes with `train_per_class[c]` training rows of class c."""
    rs = np.random.default_rng(seed)
    store = root / name
    for k in range(clients):
        for split, per in (("train", train_per_class), ("test", [test_per_class] * 3)):
            y = np.repeat(np.arange(3), per)
            x = (CENTRES[y] + 0.3 * rs.normal(size=(len(y), 4))).astype(np.float32)
            f = root / f"{name}-{k}-{split}.npz"
            np.savez(f, features=x, labels=y)
            import_features(store, f, backbone="bb", client=f"c{k}", split=split, domain="d", classes=list(classes))
    return store


def _train(store, out, algorithm, *extra):
    return CliRunner().invoke(main, ["train", "--store", str(store), "--backbones", "bb", "--algorithm", algorithm,
                                     "--seeds", "0", "--quiet", "--out", str(out), *extra], catch_exceptions=False)


def test_fedpft_refuses_a_head_no_mixture_reached(tmp_path):
    """One training feature of each class per client: no mixture can be fitted, so the head
    would be its random initialisation; refused in one line, no run written."""
    store = _store(tmp_path, "one.zarr", "abc", [1, 1, 1])
    r = _train(store, tmp_path / "pft", "fedpft", "--rounds", "1")
    assert_one_line(r, 2, "fedpft: no client sent a Gaussian mixture", "random initialisation")
    assert not (tmp_path / "pft" / "results.json").exists()
    assert _train(store, tmp_path / "ncm", "fedncm", "--rounds", "1").exit_code == 0  # the same store trains FedNCM


def test_fedpft_names_the_classes_no_client_sent(tmp_path):
    """Class c has one feature per client: the head trains on a and b and a note names c, in
    the console and in results.json."""
    store = _store(tmp_path, "c1.zarr", "abc", [6, 6, 1])
    r = _train(store, tmp_path / "pft", "fedpft", "--rounds", "1", "--set", "server_lr=0.01")
    assert r.exit_code == 0, r.output
    assert "note: fedpft: no client sent a mixture of class(es) c " in r.output
    res = json.loads((tmp_path / "pft" / "results.json").read_text())
    assert res["notes"] == [line[len("note: "):] for line in r.output.splitlines() if line.startswith("note: fedpft")]
    full = _train(_store(tmp_path, "full.zarr", "abc", [6, 6, 6]), tmp_path / "full", "fedpft", "--rounds", "1")
    assert full.exit_code == 0 and "note:" not in full.output
    assert "notes" not in json.loads((tmp_path / "full" / "results.json").read_text())


@pytest.mark.parametrize("covariance", ["spherical", "diag", "full", "tied"])
def test_fedpft_fits_fewer_components_to_a_small_class(covariance):
    """A class of n <= K features is fitted with n - 1 components (its other slots weight 0), as
    scikit-learn fits them; small_classes="skip" sends nothing of it (the baseline's rule); a
    class of one feature is never sent."""
    rs = np.random.default_rng(3)
    x = rs.normal(size=(3 + 5 + 1, 4))
    y = np.array([0] * 3 + [1] * 5 + [2])
    cfg = FedPFTConfig(components=4, covariance=covariance)
    w, m, s, n = fit_mixtures(x, y, 3, cfg, seed=5, client=2)
    assert n.tolist() == [3, 5, 0] and not w[2].any() and not m[2].any()
    for c, k in ((0, 2), (1, 4)):
        g = GaussianMixture(n_components=k, covariance_type=covariance, tol=1e-12, max_iter=1000,
                            random_state=gmm_seed(5, 2, c)).fit(x[y == c])
        np.testing.assert_allclose(w[c, :k], g.weights_)
        np.testing.assert_allclose(m[c, :k], g.means_)
        np.testing.assert_allclose(s[c] if covariance == "tied" else s[c, :k], g.covariances_)
        assert not w[c, k:].any() and not m[c, k:].any()
    skip = fit_mixtures(x, y, 3, FedPFTConfig(components=4, covariance=covariance, small_classes="skip"), 5, 2)
    assert skip[3].tolist() == [0, 5, 0]
    with pytest.raises(UserError, match="small_classes 'most'"):
        FedPFTConfig(small_classes="most")


def test_fedpft_fewer_components_train_where_the_baseline_sends_nothing():
    """K = 40, more than any client holds of a class: the baseline's rule sends nothing; the
    default fits n - 1 components per class and learns the classes."""
    from fed_tiny import tiny_fed

    from fedheads.algorithms import create_algorithm
    from fedheads.core import run

    data = tiny_fed(M=4, D=4, C=3, seed=1)
    few = run(create_algorithm("fedpft", components=40, server_lr=1e-2, server_epochs=20), data, 1, seed=0,
              progress=False)
    assert bool((few.server_state.counts > 0).any())
    assert float(few.final_accuracy().mean()) > 0.5
    alg = create_algorithm("fedpft", components=40, small_classes="skip")
    skipped = run(alg, data, 1, seed=0, progress=False)
    with pytest.raises(UserError, match="no client sent a Gaussian mixture"):
        alg.trained_notes(skipped.server_state, ["a", "b", "c"])


def test_ccvr_refuses_a_head_trained_on_other_classes(tmp_path):
    """--set head=RUN of a run trained on classes cat,dog,eel, calibrated on a store of classes
    k0,k1,k2 (same dimension, same count): refused in one line naming both class lists; a head of
    the same store calibrates."""
    other = _store(tmp_path, "animals.zarr", ["cat", "dog", "eel"], [6, 6, 6])
    here = _store(tmp_path, "ks.zarr", ["k0", "k1", "k2"], [6, 6, 6], seed=1)
    assert _train(other, tmp_path / "lp-other", "lp", "--rounds", "2").exit_code == 0
    assert _train(here, tmp_path / "lp-here", "lp", "--rounds", "2").exit_code == 0
    r = _train(here, tmp_path / "cal", "ccvr", "--rounds", "1", "--set", f"head={tmp_path / 'lp-other'}")
    assert_one_line(r, 2, "head=", "classes cat,dog,eel", "classes k0,k1,k2")
    assert not (tmp_path / "cal" / "results.json").exists()
    ok = _train(here, tmp_path / "cal2", "ccvr", "--rounds", "1", "--set", f"head={tmp_path / 'lp-here'}")
    assert ok.exit_code == 0, ok.output


def test_saved_run_of_other_features_is_refused(tmp_path):
    """The same classes but another backbone identity (weights) or other backbone names."""
    from fedheads.run.identity import check_saved_run

    run = tmp_path / "run"
    run.mkdir()
    fp = {"classes": ["a", "b"], "backbones": {"bb": {"dim": 4, "weights_sha256": "aa" * 32, "preprocess": None}}}
    (run / "config.json").write_text(json.dumps({"store_fingerprint": fp}))
    check_saved_run("head=run", run, ["a", "b"], fp["backbones"])  # the same: nothing to say
    with pytest.raises(UserError, match=r"weights \(sha256\) differs"):
        check_saved_run("head=run", run, ["a", "b"], {"bb": {**fp["backbones"]["bb"], "weights_sha256": "bb" * 32}})
    with pytest.raises(UserError, match="backbones bb, this run on cc"):
        check_saved_run("head=run", run, ["a", "b"], {"cc": fp["backbones"]["bb"]})
    from fedheads.run.identity import classes_hash

    check_saved_run("head=run", run, classes_hash(["a", "b"]), fp["backbones"])  # a Flower node's class hash
    with pytest.raises(UserError, match="another class list"):
        check_saved_run("head=run", run, classes_hash(["b", "a"]), fp["backbones"])
    with pytest.raises(UserError, match="not a fedheads run directory"):
        check_saved_run("head=nowhere", tmp_path / "nowhere", ["a"], {})


def test_pipeline_backbone_mapping_to_an_unknown_backbone_is_refused():
    from pipelines.cli import main as pipelines_main

    r = CliRunner().invoke(pipelines_main, ["run", "fedpcl-table2", "--scale", "smoke", "--dry-run",
                                            "--backbone", "resnet20-cifar10=nosuch-backbone"])
    assert_one_line(r, 2, "--backbone resnet20-cifar10=nosuch-backbone", "unknown backbone 'nosuch-backbone'",
                    "digitnet-builtin")
    r = CliRunner().invoke(pipelines_main, ["run", "fedpcl-table2", "--scale", "smoke", "--dry-run",
                                            "--backbone", "resnet20-cifar=digitnet-builtin"])
    assert_one_line(r, 2, "no selected experiment names backbone 'resnet20-cifar'", "did you mean resnet20-cifar10")


def test_a_mapped_backbone_that_cannot_run_is_not_replaced_by_the_fallback():
    """NAME=OTHER with OTHER registered but unavailable here: the arm says so instead of
    running the fallback backbone."""
    from pipelines.plan import choose_backbones
    from pipelines.spec import BackboneSet

    bs = BackboneSet("x", ("resnet20-cifar10",), ("resnet20-cifar10",), ("digitnet-builtin",))
    names, _, prob = choose_backbones(bs, False, {"resnet20-cifar10": "missing:thing"})
    assert names == () and "--backbone resnet20-cifar10=missing:thing" in prob
    names, note, prob = choose_backbones(bs, False, {"resnet20-cifar10": "digitnet-builtin"})
    assert names == ("digitnet-builtin",) and not prob
