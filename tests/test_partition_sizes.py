"""`embedcache partition --client-sizes`: label shift with a real federation's client sizes
(embedcache.federation_shapes). The sizes are reproduced exactly when the client count matches,
everything is seeded, and what cannot work is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_partition import _folder

from embedcache.cli import main
from embedcache.federation_shapes import draw_sizes, load_shape
from embedcache.manifest import load_manifest
from embedcache.partitioning import Recipe, sized_split

SIZES = [10, 6, 4, 3, 2, 2, 1, 1, 1, 1]  # 31 of the folder's 69 images


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("imgs"))


@pytest.fixture(scope="module")
def shape_csv(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("shape") / "sizes.csv"
    p.write_text("client_rank,train_images\n" + "".join(f"{i},{n}\n" for i, n in enumerate(SIZES)))
    return p


def _run(*args: str):
    return CliRunner().invoke(main, ["partition", *args])


def test_sizes_are_reproduced_exactly_and_the_rest_is_tested_on(root, shape_csv, tmp_path):
    out = tmp_path / "m.json"
    res = _run(f"imagefolder:{root}", "--scheme", "label-shift", "--client-sizes", str(shape_csv), "--alpha", "0.3",
               "--out", str(out))
    assert res.exit_code == 0, res.output
    m = load_manifest(out)
    assert sorted((len(c.train) for c in m.clients), reverse=True) == SIZES
    assert m.recipe["client_sizes"] == str(shape_csv) and m.recipe["clients"] == len(SIZES)
    assert m.recipe["train_fraction"] is None and m.recipe["min_samples"] is None  # replaced by the shape
    locs = [s.locator for c in m.clients for part in (c.train, c.test) for s in part]
    assert len(locs) == len(set(locs)) == 69  # a partition of the pool: each image once, none lost
    for c in m.clients:
        assert {s.label for s in c.test} <= {s.label for s in c.train}  # tested on the classes it holds
    assert m.report["client_sizes"]["train_samples"] == sum(SIZES)
    # seeded: the same bytes again, others for another seed
    again = tmp_path / "m2.json"
    _run(f"imagefolder:{root}", "--scheme", "label-shift", "--client-sizes", str(shape_csv), "--alpha", "0.3",
         "--out", str(again))
    assert again.read_bytes() == out.read_bytes()
    other = tmp_path / "m3.json"
    _run(f"imagefolder:{root}", "--scheme", "label-shift", "--client-sizes", str(shape_csv), "--alpha", "0.3",
         "--seed", "1", "--out", str(other))
    assert other.read_bytes() != out.read_bytes()


def test_clients_draws_that_many_sizes_at_the_shapes_quantiles(root, tmp_path):
    out = tmp_path / "m.json"
    res = _run(f"imagefolder:{root}", "--scheme", "label-shift", "--client-sizes", "inaturalist-users-120k",
               "--clients", "5", "--out", str(out))
    assert res.exit_code == 0, res.output
    got = sorted((len(c.train) for c in load_manifest(out).clients), reverse=True)
    assert got == draw_sizes(load_shape("inaturalist-users-120k"), 5).tolist()


def test_inaturalist_shape_at_full_size():
    """All 9,275 clients on a pool of 130,000 samples of 1,203 long-tailed classes: exactly the
    shipped sizes, every sample at most once, labels skewed per client."""
    rng = np.random.default_rng(0)
    w = 1.0 / np.arange(1, 1204)
    labels = rng.choice(1203, size=130_000, p=w / w.sum())
    by_class = {int(c): [f"s{i}" for i in np.flatnonzero(labels == c)] for c in np.unique(labels)}
    sizes = load_shape("inaturalist-users-120k")
    parts = sized_split(by_class, sizes[rng.permutation(len(sizes))], 0.05, rng)
    assert sorted((len(p) for p in parts), reverse=True) == sizes.tolist()
    taken = [loc for p in parts for loc, _ in p]
    assert len(taken) == len(set(taken)) == 120_293
    p = np.bincount(labels, minlength=1203) / len(labels)
    big = [[lab for _, lab in part] for part in parts if len(part) >= 50]
    iid = np.median([len(set(rng.choice(1203, size=len(b), p=p))) for b in big])  # the same sizes, no skew
    assert np.median([len(set(b)) for b in big]) < 0.8 * iid  # fewer classes per client than the pool would give


def test_exhausted_classes_are_redrawn_not_overdrawn():
    by_class = {0: ["a0", "a1"], 1: [f"b{i}" for i in range(10)]}
    parts = sized_split(by_class, np.array([5, 5, 2]), 0.01, np.random.default_rng(0))
    assert [len(p) for p in parts] == [5, 5, 2]
    assert sorted(loc for p in parts for loc, _ in p) == sorted(by_class[0] + by_class[1])


@pytest.mark.parametrize("args, start", [
    (["--scheme", "label-shift", "--client-sizes", "inat"], "error: --client-sizes inat: neither a shipped shape"),
    (["--scheme", "label-shift", "--client-sizes", "inaturalist-users-120k"],
     "error: --client-sizes inaturalist-users-120k: 9275 clients need 120293 training samples and the source has 69; "
     "use --clients"),
    (["--scheme", "feature-shift", "--client-sizes", "gldv2"], "error: --client-sizes: not used by feature-shift"),
    (["--scheme", "label-shift", "--client-sizes", "gldv2", "--train-fraction", "0.5"],
     "error: --train-fraction: not used with --client-sizes"),
    (["--scheme", "label-shift", "--client-sizes", "gldv2", "--min-samples", "3"],
     "error: --min-samples: not used with --client-sizes"),
    (["--preset", "fedncm", "--client-sizes", "gldv2"], "error: --client-sizes: --preset fedncm fixes its own"),
])
def test_what_cannot_work_is_one_line(root, tmp_path, args, start):
    out = tmp_path / "m.json"
    res = _run(f"imagefolder:{root}", *args, "--out", str(out))
    assert res.exit_code == 2 and res.output.count("\n") == 1 and res.output.startswith(start), res.output
    assert not out.exists()


def test_the_suggested_client_count_fits(root, tmp_path):
    res = _run(f"imagefolder:{root}", "--scheme", "label-shift", "--client-sizes", "gldv2", "--out", str(tmp_path / "x.json"))
    fit = res.output.split("--clients ")[1].split(" ")[0]
    assert int(fit) >= 1
    res = _run(f"imagefolder:{root}", "--scheme", "label-shift", "--client-sizes", "gldv2", "--clients", fit,
               "--out", str(tmp_path / "z.json"))
    assert res.exit_code == 0, res.output
    res = _run(f"imagefolder:{root}", "--scheme", "label-shift", "--client-sizes", "gldv2", "--clients", str(int(fit) + 1),
               "--out", str(tmp_path / "w.json"))
    assert res.exit_code == 2  # the most that fit


def test_manifests_without_client_sizes_keep_their_recipe_bytes():
    assert "client_sizes" not in Recipe("label-shift").resolved().as_dict()
