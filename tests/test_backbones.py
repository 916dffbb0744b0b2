"""Contract test over every backbone whose weights are present (docs/contracts.md section 3),
the timm-style "one test over the whole registry"."""

from __future__ import annotations

import json
import re

import pytest
import torch
from backbone_doubles import TIMM_MODEL, TINY_RECIPE, TV_MODEL, build_weights_dir
from conftest import shared_dir
from PIL import Image
from text_doubles import check_text_backbone

from embedcache.backbones import Backbone, create_backbone, digitnet, list_backbones, registered_names
from embedcache.backbones.base import TorchBackbone

NAMES = registered_names() + [f"timm:{TIMM_MODEL}", f"tv:{TV_MODEL}"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Offline, a private cache, and the tiny digitnet recipe, for this module only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBEDCACHE_OFFLINE", "1")
        mp.setenv("EMBEDCACHE_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.setattr(digitnet, "DEFAULT_RECIPE", TINY_RECIPE)
        yield build_weights_dir(tmp_path_factory.mktemp("weights"), shared_dir())


@pytest.fixture(scope="module")
def built(env):
    cache: dict[str, Backbone] = {}

    def get(name: str) -> Backbone:
        if name not in cache:
            rows = {r.name: r for r in list_backbones(env)}
            if name in rows and not rows[name].available:
                pytest.skip(f"{name}: {rows[name].reason}")
            cache[name] = create_backbone(name, weights_dir=env)
        return cache[name]

    return get


def _images() -> list[Image.Image]:
    g = torch.Generator().manual_seed(0)
    rgb = (torch.rand(3, 48, 40, 3, generator=g) * 255).to(torch.uint8).numpy()
    return [Image.fromarray(rgb[0]), Image.fromarray(rgb[1]).convert("L"), Image.fromarray(rgb[2])]


@pytest.mark.parametrize("name", NAMES)
def test_backbone_contract(name, built):
    bb = built(name)
    assert bb.name == name
    assert re.fullmatch(r"[0-9a-f]{64}", bb.weights_sha256)
    json.loads(json.dumps(bb.preprocess))  # JSON-able as is
    if getattr(bb, "modality", "image") == "text":  # contract 3d: texts in, the same output rules
        return check_text_backbone(bb)
    assert getattr(bb, "modality", "image") == "image"
    size = tuple(bb.preprocess["input_size"])

    views = [bb.transform(im) for im in _images()]
    for v in views:
        assert v.dtype == torch.float32 and tuple(v.shape) == size
    torch.manual_seed(0)
    aug = bb.transform(_images()[0], train=True)
    assert aug.dtype == torch.float32 and tuple(aug.shape) == size

    batch = torch.stack(views)
    if isinstance(bb, TorchBackbone):
        before = {k: v.clone() for k, v in bb.module.state_dict().items()}
    out = bb.embed(batch)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert tuple(out.shape) == (3, bb.feature_dim)
    assert torch.isfinite(out).all()
    assert torch.equal(out, bb.embed(batch)), "embed must be deterministic"
    one = bb.embed(batch[1:2])
    assert torch.allclose(one[0], out[1], atol=1e-5, rtol=1e-5), "batch of 1 must equal a row of a batch of 3"
    if isinstance(bb, TorchBackbone):
        assert not any(m.training for m in bb.module.modules()), "backbone must stay in eval mode"
        after = bb.module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "embedding changed the weights/BN stats"


def test_every_registered_name_is_listed(env):
    listed = {r.name for r in list_backbones(env)}
    assert set(registered_names()) <= listed
    assert {"timm:<model>", "tv:<model>", f"timm:{TIMM_MODEL}", f"tv:{TV_MODEL}"} <= listed
    for required in ("resnet20-cifar10", "resnet56-cifar10", "resnet18-quickdraw", "resnet18-aircraft",
                     "resnet18-birds", "mobilenet-v1-embed-tflite", "mobilenet-v2-tflite", "digitnet-builtin"):
        assert required in registered_names()


def test_feature_dims_in_listing_match_built(env, built):
    rows = {r.name: r for r in list_backbones(env)}
    for name in ("resnet18-quickdraw", "resnet18-birds"):
        assert rows[name].feature_dim == built(name).feature_dim
