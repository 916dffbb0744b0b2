"""Real federations' client sizes (embedcache.federation_shapes): the shipped counts are the
published ones, a CSV of one's own reads in each accepted form, resampling keeps the shape, and
bad input is one line."""

from __future__ import annotations

import numpy as np
import pytest

from embedcache.errors import UserError
from embedcache.federation_shapes import SHAPES, draw_sizes, load_shape


@pytest.mark.parametrize("name, clients, rows, median, largest, smallest", [
    ("inaturalist-users-120k", 9275, 120293, 2, 2511, 1),
    ("gldv2", 1262, 151373, 60, 2858, 25),
])
def test_shipped_shapes_have_the_published_counts(name, clients, rows, median, largest, smallest):
    s = load_shape(name)
    assert (len(s), int(s.sum()), np.median(s), s.max(), s.min()) == (clients, rows, median, largest, smallest)
    assert (np.diff(s) <= 0).all()  # largest first


@pytest.mark.shared
def test_shipped_shapes_equal_the_source_csvs(shared):
    """The run-length files hold exactly the per-client counts of ../shared/data/federation_shapes."""
    src = shared / "data" / "federation_shapes"
    if not src.is_dir():
        pytest.skip(f"{src} is not present")
    for name, file in (("inaturalist-users-120k", "inaturalist_user_120k.csv"), ("gldv2", "gldv2.csv")):
        want = np.loadtxt(src / file, delimiter=",", skiprows=1, dtype=np.int64)[:, 1]
        assert np.array_equal(load_shape(name), want)
        assert np.array_equal(load_shape(src / file), want)  # the per-client form reads too


def test_csv_forms(tmp_path):
    (tmp_path / "rle.csv").write_text("train_images,clients\n5,2\n1,3\n")
    (tmp_path / "per.csv").write_text("client_rank,train_images\n0,1\n1,5\n2,1\n3,5\n4,1\n")
    (tmp_path / "plain.csv").write_text("1\n5\n\n1\n5\n1\n")
    for f in ("rle.csv", "per.csv", "plain.csv"):
        assert load_shape(tmp_path / f).tolist() == [5, 5, 1, 1, 1], f


def test_draw_sizes_is_exact_at_the_shapes_own_count_and_keeps_its_shape_elsewhere():
    s = load_shape("inaturalist-users-120k")
    assert np.array_equal(draw_sizes(s), s) and np.array_equal(draw_sizes(s, len(s)), s)
    for m in (1000, 300):
        d = draw_sizes(s, m)
        assert len(d) == m and np.median(d) == 2 and d.min() == 1 and (np.diff(d) <= 0).all()
        assert abs(d.mean() - s.mean()) / s.mean() < 0.1  # the mean too, within the tail's granularity
    assert draw_sizes(np.array([7, 3]), 4).tolist() == [7, 7, 3, 3]


@pytest.mark.parametrize("content, match", [
    ("train_images,clients\n5,x\n", r"line 2: '5,x' is not a client size"),
    ("train_images,clients\n5,0\n", r"line 2: '5,0': sizes and counts must be >= 1"),
    ("a,b\n1,2\n", r"header 'a,b'"),
    ("\n", r"no client sizes"),
])
def test_bad_csv_is_one_line(tmp_path, content, match):
    (tmp_path / "bad.csv").write_text(content)
    with pytest.raises(UserError, match=match) as e:
        load_shape(tmp_path / "bad.csv")
    assert "\n" not in str(e.value)


def test_unknown_name_is_one_line_listing_the_shapes():
    with pytest.raises(UserError, match="inaturalist-users-121k: neither a shipped shape") as e:
        load_shape("inaturalist-users-121k")
    assert all(n in str(e.value) for n in SHAPES) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="--clients 0"):
        draw_sizes(load_shape("gldv2"), 0)
