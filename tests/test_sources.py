"""Image sources on real data (Office-Caltech-10 from ../shared) and the public synthetic
digit renderer that the digitnet-builtin backbone pre-trains on."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from embedcache.errors import UserError
from embedcache.sources import open_source
from embedcache.sources.builtin_digits import SYNTH_SEED, render_synth_digits


def test_office_caltech10_index(shared):
    root = shared / "data" / "office_caltech10"
    if not root.is_dir():
        pytest.skip(f"{root} not present")
    src = open_source(f"imagefolder:{root}")
    assert src.domains() == ["amazon", "caltech10", "dslr", "webcam"]
    assert len(src.classes()) == 10 and src.classes() == sorted(src.classes())
    idx = src.index()
    assert len(idx) == 2533 and idx == sorted(idx)
    # The per-domain counts the shared README gives.
    assert Counter(d for d, _, _ in idx) == {"amazon": 958, "caltech10": 1123, "dslr": 157, "webcam": 295}
    dom, loc, label = idx[0]
    assert loc.startswith(f"{dom}/{src.classes()[label]}/")
    img = src.load(loc)
    assert img.mode == "RGB" and min(img.size) > 0
    with pytest.raises(UserError, match="amazon/backpack/nope.jpg"):
        src.load("amazon/backpack/nope.jpg")


def test_render_synth_digits_shape_balance_and_determinism():
    x, y = render_synth_digits(40, seed=7, size=32)
    assert x.shape == (40, 32, 32, 3) and x.dtype == np.uint8
    assert y.dtype == np.int64 and np.array_equal(np.bincount(y), [4] * 10)
    x2, y2 = render_synth_digits(40, seed=7, size=32)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    x3, _ = render_synth_digits(40, seed=SYNTH_SEED + 1, size=32)
    assert not np.array_equal(x, x3)
    assert x.std() > 10  # not blank: digits over coloured backgrounds
