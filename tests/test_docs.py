"""The documentation's code runs: docs/custom_backbone.md's backbone registers, extracts and
caches like a built-in one."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from embedcache.backbones import registry

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture
def tiny_cnn():
    yield
    registry._REGISTRY.pop("tiny-cnn", None)  # the registry is process-wide: leave it as it was
    registry._FAMILIES.pop("tiny-cnn:", None)


def test_custom_backbone_page_registers_and_extracts(tiny_cnn, tmp_path):
    import embedcache

    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "custom_backbone.md").read_text(), re.S)
    assert len(blocks) == 1, "docs/custom_backbone.md: expected one python block"
    exec(compile(blocks[0], "custom_backbone.md", "exec"), {})
    info = {b.name: b for b in registry.list_backbones()}["tiny-cnn"]
    assert info.available and info.feature_dim == 8
    manifest = embedcache.partition("builtin:digits", scheme="feature-shift", train_per_class=2, test_per_class=1)
    store = tmp_path / "feats.zarr"
    first = embedcache.extract(manifest, "tiny-cnn", store, progress=False)
    again = embedcache.extract(manifest, "tiny-cnn", store, progress=False)
    train = embedcache.load_split(store, "tiny-cnn", "train")
    feats = next(iter(train.values())).features
    assert feats.shape[1] == 8 and np.isfinite(feats).all()
    assert first.changed and not again.changed and again.cache_hits == again.shards  # re-run: cache hits
    wide = embedcache.extract(manifest, "tiny-cnn:16", store, progress=False)  # the family's name
    assert wide.changed and next(iter(embedcache.load_split(store, "tiny-cnn:16", "train").values())).features.shape[1] == 16


README = DOCS.parent / "README.md"


def test_readme_is_a_front_door_whose_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for link in re.findall(r"\]\(((?:docs|data_manifests)/[^)#]+)", text):
        assert (README.parent / link).is_file(), f"README links to a missing {link}"
