"""Each backbone source: real weights where ../shared has them, test-written checkpoints in
the real on-disk formats otherwise; error paths (missing, corrupt, wrong keys)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from backbone_doubles import TIMM_MODEL, TV_MODEL, write_sur_checkpoint, write_timm_checkpoint, write_tv_checkpoint
from click.testing import CliRunner
from PIL import Image

from embedcache.backbones import create_backbone, default_backbones, default_backbones_with_reason
from embedcache.backbones import weights as W
from embedcache.backbones.cifar_resnet import CHECKPOINTS
from embedcache.errors import UserError

CIFAR10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBEDCACHE_OFFLINE", "1")
    monkeypatch.setenv("EMBEDCACHE_CACHE", str(tmp_path / "cache"))
    for var in ("EMBEDCACHE_WEIGHTS", "EMBEDCACHE_ASSETS"):
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------------------------ CIFAR ResNets (real weights)
@pytest.mark.shared
def test_resnet20_real_images_and_dropped_classifier(shared):
    wd = shared / "weights"
    if not (wd / "cifar10_resnet").is_dir():
        pytest.skip("cifar10_resnet weights not present")
    bb = create_backbone("resnet20-cifar10", weights_dir=wd)
    assert bb.feature_dim == 64 and bb.weights_sha256 == CHECKPOINTS[20][1]
    assert not hasattr(bb.module, "linear"), "the CIFAR-10 classifier must not be part of the embedder"
    office = sorted((shared / "data" / "office_caltech10" / "amazon").glob("*/frame_0001.jpg"))[:3]
    cat = shared / "weights" / "coral_mobilenet" / "cat_720p.jpg"
    imgs = [Image.open(p) for p in office + [cat]]
    feats = bb.embed(torch.stack([bb.transform(im) for im in imgs]))
    assert feats.shape == (len(imgs), 64) and torch.isfinite(feats).all()
    assert (feats >= 0).all(), "post-ReLU average pool is non-negative"
    # The classifier IS in the weights file: applied to our feature it must call the cat a cat,
    # which checks the whole trunk (option-A shortcuts, BN, pooling) against the published model.
    ckpt = torch.load(wd / "cifar10_resnet" / CHECKPOINTS[20][0], map_location="cpu", weights_only=True)
    w, b = ckpt["state_dict"]["module.linear.weight"], ckpt["state_dict"]["module.linear.bias"]
    assert w.shape == (10, 64)
    assert CIFAR10[int((feats[-1] @ w.T + b).argmax())] == "cat"


def test_cifar_sha_mismatch_names_the_file(tmp_path):
    bad = tmp_path / "cifar10_resnet" / CHECKPOINTS[20][0]
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not the published checkpoint")
    with pytest.raises(UserError, match=r"resnet20-12fca82f\.th: sha256 .* does not match"):
        create_backbone("resnet20-cifar10", weights_dir=tmp_path)


def test_missing_weights_names_backbone_and_places(tmp_path):
    with pytest.raises(UserError) as err:
        create_backbone("resnet32-cifar10", weights_dir=tmp_path / "empty")
    msg = str(err.value)
    assert msg.startswith("resnet32-cifar10: weights not found")
    assert str(tmp_path / "empty" / "cifar10_resnet" / CHECKPOINTS[32][0]) in msg
    assert "\n" not in msg


def test_unknown_backbone():
    with pytest.raises(UserError, match="nope: unknown backbone"):
        create_backbone("nope")


# ------------------------------------------------------------------ SUR ResNet-18
def test_sur_checkpoint_loads_strictly(tmp_path):
    state = write_sur_checkpoint(tmp_path / "aircraft-net" / "model_best.pth.tar", seed=3, prefix="module.")
    bb = create_backbone("resnet18-aircraft", weights_dir=tmp_path)
    assert bb.feature_dim == 512 and tuple(bb.preprocess["input_size"]) == (3, 64, 64)
    got = bb.module.state_dict()
    assert torch.equal(got["layer3.0.downsample.0.weight"], state["module.layer3.0.downsample.0.weight"])
    assert got["conv1.weight"].shape == (64, 3, 5, 5)
    assert not any(k.startswith("cls_fn") for k in got)
    assert bb.module.initial_pool is False  # SUR trained without the initial max-pool


@pytest.mark.parametrize("rename", [("layer2.1.conv1.weight", "layer2.1.conv9.weight"), ("bn1.running_var", "bn1.running_varx")])
def test_sur_wrong_key_is_user_error(tmp_path, rename):
    write_sur_checkpoint(tmp_path / "quickdraw-net" / "model_best.pth.tar", rename=rename)
    with pytest.raises(UserError, match=r"resnet18-quickdraw .*does not match the architecture: missing keys"):
        create_backbone("resnet18-quickdraw", weights_dir=tmp_path)


def test_sur_without_state_dict_is_user_error(tmp_path):
    p = tmp_path / "cu_birds-net" / "model_best.pth.tar"
    p.parent.mkdir()
    torch.save({"weights": {}}, p)
    with pytest.raises(UserError, match="expected a dict with a 'state_dict'"):
        create_backbone("resnet18-birds", weights_dir=tmp_path)


# ------------------------------------------------------------------ timm / torchvision
def test_timm_local_checkpoint(tmp_path):
    state = write_timm_checkpoint(tmp_path / "timm" / f"{TIMM_MODEL}.safetensors", seed=1)
    bb = create_backbone(f"timm:{TIMM_MODEL}", weights_dir=tmp_path)
    assert bb.preprocess["pipeline"] == "timm" and bb.preprocess["input_size"] == [3, 160, 160]
    assert bb.feature_dim == bb.module.num_features  # measured, equals timm's claim for this net
    key = next(k for k in state if k.endswith("conv1.0.weight"))
    assert torch.equal(bb.module.state_dict()[key], state[key])
    assert bb.weights_sha256 == W.sha256_file(tmp_path / "timm" / f"{TIMM_MODEL}.safetensors")


def test_timm_wrong_key_and_missing(tmp_path):
    from safetensors.torch import save_file

    state = write_timm_checkpoint(tmp_path / "timm" / f"{TIMM_MODEL}.safetensors")
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "timm" / f"{TIMM_MODEL}.safetensors"))
    with pytest.raises(UserError, match="unexpected keys"):
        create_backbone(f"timm:{TIMM_MODEL}", weights_dir=tmp_path)
    with pytest.raises(UserError, match="timm:test_vit: weights not found"):
        create_backbone("timm:test_vit", weights_dir=tmp_path)
    with pytest.raises(UserError, match="timm:no_such_net"):
        create_backbone("timm:no_such_net", weights_dir=tmp_path)


def test_tv_local_checkpoint(tmp_path):
    write_tv_checkpoint(tmp_path / "tv" / f"{TV_MODEL}.pth", seed=2)
    bb = create_backbone(f"tv:{TV_MODEL}", weights_dir=tmp_path)
    assert bb.feature_dim == 1024  # classifier hidden layer; the 1000-way Linear is removed
    assert bb.preprocess["crop"] == [224, 224] and bb.preprocess["resize"] == 256
    with pytest.raises(UserError, match="tv:not_a_model: not a torchvision"):
        create_backbone("tv:not_a_model", weights_dir=tmp_path)


# ------------------------------------------------------------------ TFLite
@pytest.mark.shared
def test_mobilenet_v2_tflite_says_egyptian_cat(shared):
    pytest.importorskip("ai_edge_litert")
    wd = shared / "weights"
    if not (wd / "coral_mobilenet").is_dir():
        pytest.skip("coral_mobilenet not present")
    bb = create_backbone("mobilenet-v2-tflite", weights_dir=wd)
    x = bb.transform(Image.open(wd / "coral_mobilenet" / "cat_720p.jpg"))
    assert x.dtype == torch.float32 and torch.equal(x, x.round()) and 0 <= x.min() and x.max() <= 255
    labels = (wd / "coral_mobilenet" / "imagenet_labels.txt").read_text().splitlines()
    scores = bb.outputs(x[None])
    assert scores.shape == (1, 1001) and labels[int(scores.argmax())] == "Egyptian cat"
    feat = bb.embed(x[None])
    assert feat.shape == (1, 1280) and (feat >= 0).all() and feat.max() > 0
    v1 = create_backbone("mobilenet-v1-embed-tflite", weights_dir=wd)
    assert v1.embed(x[None]).shape == (1, 1024)


def test_tflite_missing_package_is_user_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ai_edge_litert.interpreter", None)
    with pytest.raises(UserError, match="ai-edge-litert is not installed"):
        create_backbone("mobilenet-v2-tflite", weights_dir=tmp_path)


# ------------------------------------------------------------------ weights dir, download, defaults
def test_weights_dir_priority(monkeypatch, tmp_path):
    cwd = tmp_path / "repo"
    (tmp_path / "shared" / "weights").mkdir(parents=True)
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert W.resolve_weights_dir() == Path("..").resolve() / "shared" / "weights"
    monkeypatch.setenv("EMBEDCACHE_ASSETS", str(tmp_path / "assets"))
    assert W.resolve_weights_dir() == tmp_path / "assets" / "weights"
    monkeypatch.setenv("EMBEDCACHE_WEIGHTS", str(tmp_path / "w"))
    assert W.resolve_weights_dir() == tmp_path / "w"
    assert W.resolve_weights_dir(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("EMBEDCACHE_WEIGHTS")
    monkeypatch.delenv("EMBEDCACHE_ASSETS")
    (tmp_path / "shared" / "weights").rmdir()
    assert W.resolve_weights_dir() == tmp_path / "cache" / "weights"


def test_download_verifies_then_moves(monkeypatch, tmp_path):
    import hashlib

    import torch.hub

    payload = b"published bytes"
    monkeypatch.setattr(torch.hub, "download_url_to_file", lambda url, dst, progress=True: Path(dst).write_bytes(payload))
    good = hashlib.sha256(payload).hexdigest()
    with pytest.raises(UserError, match=r"x\.th.*sha256 .* does not match"):
        W.download("https://example.invalid/x.th", "sub/x.th", "0" * 64, who="demo")
    assert not list((tmp_path / "cache" / "weights" / "sub").iterdir()), "no partial file may remain"
    path = W.download("https://example.invalid/x.th", "sub/x.th", good, who="demo")
    assert path.read_bytes() == payload and path == tmp_path / "cache" / "weights" / "sub" / "x.th"


def test_default_backbones(tmp_path):
    names, why = default_backbones_with_reason(tmp_path)
    assert names == ["digitnet-builtin"] and "resnet20-cifar10 unavailable" in why
    f = tmp_path / "cifar10_resnet" / CHECKPOINTS[20][0]
    f.parent.mkdir()
    f.write_bytes(b"x")
    assert default_backbones(tmp_path) == ["resnet20-cifar10"]


def test_cuda_request_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    write_sur_checkpoint(tmp_path / "aircraft-net" / "model_best.pth.tar")
    with pytest.raises(UserError, match="CUDA is not available"):
        create_backbone("resnet18-aircraft", weights_dir=tmp_path, device="cuda")


@pytest.mark.gpu
def test_cuda_matches_cpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    write_sur_checkpoint(tmp_path / "aircraft-net" / "model_best.pth.tar")
    cpu = create_backbone("resnet18-aircraft", weights_dir=tmp_path)
    gpu = create_backbone("resnet18-aircraft", weights_dir=tmp_path, device="cuda")
    x = torch.randn(4, 3, 64, 64)
    a, b = cpu.embed(x), gpu.embed(x)
    assert b.dtype == torch.float32 and b.device.type == "cpu"
    assert torch.allclose(a, b, rtol=5e-2, atol=5e-2)  # autocast half precision


def test_cli_lists_backbones(tmp_path):
    from embedcache.cli import main

    write_sur_checkpoint(tmp_path / "quickdraw-net" / "model_best.pth.tar")
    res = CliRunner().invoke(main, ["backbones", "--weights-dir", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    rows = {r["name"]: r for r in doc["backbones"]}
    assert rows["resnet18-quickdraw"]["available"] and rows["resnet18-quickdraw"]["feature_dim"] == 512
    assert not rows["resnet18-birds"]["available"] and "cu_birds-net" in rows["resnet18-birds"]["reason"]
    assert doc["default"] == ["digitnet-builtin"]
    table = CliRunner().invoke(main, ["backbones", "--weights-dir", str(tmp_path)])
    assert table.exit_code == 0 and "resnet18-quickdraw" in table.output and "available" in table.output
    assert os.linesep.join(table.output.splitlines()[:1]).startswith("weights dir:")


def test_preprocess_dict_drives_the_transform():
    from embedcache.backbones.base import build_transform
    from embedcache.backbones.cifar_resnet import PREPROCESS

    img = Image.new("L", (40, 30), 128)  # grey input becomes RGB
    a = build_transform(PREPROCESS, train=False)(img)
    b = build_transform(dict(PREPROCESS.as_dict(), mean=[0.0, 0.0, 0.0]), train=False)(img)
    c = build_transform(dict(PREPROCESS.as_dict(), resize=[16, 16], input_size=[3, 16, 16]), train=False)(img)
    assert a.shape == (3, 32, 32) and c.shape == (3, 16, 16) and not torch.equal(a, b)


def test_timm_and_tv_from_hub_caches_offline(monkeypatch, tmp_path):
    """No local file: timm finds the HF hub cache entry, torchvision the torch hub cache file."""
    import huggingface_hub
    from torchvision import models

    st = tmp_path / "hf" / "model.safetensors"
    write_timm_checkpoint(st, seed=4)
    seen = []

    def fake_cache(repo_id, filename, **kw):
        seen.append(repo_id)
        return str(st) if filename == "model.safetensors" else None

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", fake_cache)
    bb = create_backbone(f"timm:{TIMM_MODEL}", weights_dir=tmp_path / "empty")
    assert seen and seen[0].startswith("timm/") and bb.weights_sha256 == W.sha256_file(st)

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    url = models.get_model_weights(TV_MODEL).DEFAULT.url
    write_tv_checkpoint(tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[-1], seed=5)
    tv = create_backbone(f"tv:{TV_MODEL}", weights_dir=tmp_path / "empty")
    assert tv.feature_dim == 1024
