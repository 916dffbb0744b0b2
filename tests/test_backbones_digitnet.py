"""digitnet-builtin: deterministic local pre-training, caching, disjointness from client data."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from backbone_doubles import TINY_RECIPE
from embedcache.backbones import create_backbone
from embedcache.backbones import digitnet as D
from embedcache.errors import UserError


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBEDCACHE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EMBEDCACHE_OFFLINE", "1")
    monkeypatch.delenv("EMBEDCACHE_WEIGHTS", raising=False)
    monkeypatch.delenv("EMBEDCACHE_ASSETS", raising=False)


def test_training_is_deterministic_and_leaves_global_state_alone():
    torch.manual_seed(123)
    threads = torch.get_num_threads()
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, rep = D.train_digitnet(TINY_RECIPE)
    assert torch.equal(torch.rand(1), expected_next), "training must not consume the caller's RNG"
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()
    b, _ = D.train_digitnet(TINY_RECIPE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert 0.0 <= rep["val_accuracy"] <= 1.0


def test_cached_once_then_reused(monkeypatch, tmp_path):
    monkeypatch.setattr(D, "DEFAULT_RECIPE", TINY_RECIPE)
    bb = create_backbone("digitnet-builtin")
    path = tmp_path / "cache" / "weights" / D.weights_file(TINY_RECIPE)
    assert path.is_file() and not list(path.parent.glob("*.tmp*"))
    assert bb.weights_sha256 == D.W.sha256_file(path)
    assert bb.feature_dim == TINY_RECIPE.widths[-1]
    assert bb.preprocess["provenance"] == D.PROVENANCE and bb.preprocess["recipe"] == TINY_RECIPE.digest()
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert ckpt["provenance"].startswith("pre-trained locally") and ckpt["recipe"]["seed"] == 10_000

    def boom(*a, **k):
        raise AssertionError("must not retrain when cached")

    monkeypatch.setattr(D, "train_digitnet", boom)
    again = create_backbone("digitnet-builtin")
    assert again.weights_sha256 == bb.weights_sha256
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(bb.embed(x), again.embed(x))


def test_recipe_hash_changes_with_any_field():
    assert TINY_RECIPE.digest() != D.DEFAULT_RECIPE.digest()
    from dataclasses import replace

    assert replace(D.DEFAULT_RECIPE, lr=0.2).digest() != D.DEFAULT_RECIPE.digest()


def test_pretraining_data_is_disjoint_from_clients():
    from embedcache.sources.builtin_digits import SYNTH_SEED, render_synth_digits

    with pytest.raises(UserError, match="clients' synthetic domain"):
        D.pretraining_data(10, SYNTH_SEED, 1, 0.5)
    ours, _ = D.pretraining_data(200, D.DEFAULT_RECIPE.seed, D.DEFAULT_RECIPE.background_seed, 0.5)
    theirs, _ = render_synth_digits(200, SYNTH_SEED, 32)
    flat_ours = {im.tobytes() for im in ours}
    assert not any(im.tobytes() in flat_ours for im in theirs)
    assert ours.dtype == np.uint8 and ours.shape == (200, 32, 32, 3)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("EMBEDCACHE_RUN_SLOW") != "1",
                    reason="trains the real recipe (~30-120 s on 2 cores); set EMBEDCACHE_RUN_SLOW=1")
def test_default_recipe_learns_digits():
    _, rep = D.train_digitnet(D.DEFAULT_RECIPE)
    assert rep["val_accuracy"] >= 0.7
