"""Integration: the real `resnet20-cifar10` weights on a handful of Office-Caltech-10 images."""

from __future__ import annotations

import numpy as np
import pytest
import store_doubles as d
import torch

from embedcache.backbones import create_backbone
from embedcache.extraction import ExtractConfig, extract
from embedcache.store.maintenance import verify_store
from embedcache.store.reader import load_split

pytestmark = pytest.mark.shared


def test_resnet20_on_office_caltech(shared, cifar_weights, tmp_path):
    root = shared / "data" / "office_caltech10"
    if not root.is_dir():
        pytest.skip(f"{root} not present")
    m = d.make_manifest(root, domains=("dslr", "webcam"), classes=("backpack", "mug"), per_class=3)
    wd = str(shared / "weights")
    cfg = ExtractConfig(backbones=("resnet20-cifar10",), store=str(tmp_path / "s"), weights_dir=wd, batch_size=4,
                        chunk_rows=4, progress=False)
    rep = extract(m, cfg, source=d.FolderSource(str(root)))
    assert rep.rows_computed == 12
    bb = create_backbone("resnet20-cifar10", weights_dir=wd)
    assert bb.weights_sha256 == "12fca82f0bebc4135bf1f32f6e3710e61d5108578464b84fd6d7f5c1b04036c8"
    out = load_split(tmp_path / "s", ["resnet20-cifar10"], "train")
    src = d.FolderSource(str(root))
    for c in m.clients:
        x = torch.stack([bb.transform(src.load(s.locator)) for s in c.train])
        feats = out[c.name].features
        assert feats.shape == (len(c.train), 64) and (feats >= 0).all() and feats.std() > 0  # post-ReLU pool
        np.testing.assert_allclose(feats, bb.embed(x).numpy(), rtol=1e-4, atol=1e-5)
    assert verify_store(tmp_path / "s") == []
    rep = extract(m, cfg, source=d.FolderSource(str(root), fail=True))
    assert rep.rows_computed == 0 and rep.cache_hits == 4
