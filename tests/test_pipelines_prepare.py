"""Partition and features for sweeps: each image is extracted once per backbone across manifests,
and a manifest's store derived from the feature pools is the store `embedcache extract` writes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pipelines_doubles as pd
import pytest

from embedcache.extraction import ExtractConfig, extract
from embedcache.manifest import load_manifest
from embedcache.store.reader import load_split, open_store
from pipelines.prepare import DataRequest, prepare

BACKBONES = ["pl-tiny-a", "pl-tiny-b"]


@pytest.fixture
def office(tmp_path: Path) -> Path:
    return pd.make_folder(tmp_path / "office", ("amazon", "caltech10", "dslr", "webcam"), tuple("abcde"), per_class=5)


def _request(root: Path, test_per_class: int) -> DataRequest:
    recipe = (("scheme", "feature-shift"), ("train_per_class", 2), ("test_per_class", test_per_class))
    return DataRequest(f"imagefolder:{root}", recipe, 0, "office10", True)


def _extracted(notes: list[str]) -> int:
    return sum(int(n.split()[1]) for n in notes if n.startswith("extracting "))


def test_derived_store_is_what_extract_writes(office, tmp_path):
    cache = tmp_path / "cache"
    first = prepare(_request(office, 1), BACKBONES, cache, progress=False)
    assert _extracted(first.notes) == 4 * 5 * 3  # 4 domains x 5 classes x (2 train + 1 test)
    second = prepare(_request(office, 2), BACKBONES, cache, progress=False)
    assert _extracted(second.notes) == 4 * 5 * 1  # only the images the first manifest did not use
    manifest = load_manifest(second.manifest_path)
    direct = tmp_path / "direct.zarr"
    extract(manifest, ExtractConfig(backbones=tuple(BACKBONES), store=str(direct), progress=False))
    ours, theirs = open_store(second.store), open_store(direct)
    assert [(s.backbone, s.client, s.split, s.cache_key) for s in ours.shards] == \
        [(s.backbone, s.client, s.split, s.cache_key) for s in theirs.shards]
    for split in ("train", "test"):
        a, b = load_split(second.store, BACKBONES, split), load_split(direct, BACKBONES, split)
        for c in a:
            assert list(a[c].sample_ids) == list(b[c].sample_ids)
            assert np.array_equal(a[c].features, b[c].features)  # bitwise


def test_warm_cache_computes_nothing_and_changed_images_are_repartitioned(office, tmp_path):
    cache = tmp_path / "cache"
    first = prepare(_request(office, 1), BACKBONES, cache, progress=False)
    again = prepare(_request(office, 1), BACKBONES, cache, progress=False)
    assert again.notes == [] and again.manifest_hash == first.manifest_hash
    used = load_manifest(first.manifest_path).all_samples()[0].locator  # an image the manifest holds
    img = office / used
    pd.make_folder(tmp_path / "other", ("amazon",), ("a",), per_class=1, ext="png")
    img.write_bytes((tmp_path / "other" / "amazon" / "a" / "000.png").read_bytes())
    os.utime(img, ns=(1, 1))  # other bytes (and size/mtime): the fingerprint changes
    changed = prepare(_request(office, 1), BACKBONES, cache, progress=False)
    assert any("re-partitioned" in n for n in changed.notes)
    assert changed.manifest_hash != first.manifest_hash
