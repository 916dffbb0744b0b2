"""Typed preprocessing descriptions (embedcache.backbones.preprocessing): each built-in backbone's
description records exactly the dict the store has always recorded (it is hashed into every
shard's cache key: a changed key or a 10 written as 10.0 would re-extract every existing store),
and a dict given by a custom backbone is recorded verbatim."""

from __future__ import annotations

import json
import math

import pytest
import torch

from embedcache.backbones import cifar_resnet, digitnet, efficientnet_lite, minilm, sur_resnet, tflite
from embedcache.backbones.base import TorchBackbone, build_transform
from embedcache.backbones.preprocessing import (
    ImagePreprocessing,
    RecordedPreprocessing,
    TimmPreprocessing,
    TrainAugment,
    image_preprocessing,
)
from embedcache.errors import UserError

MILD = {"kind": "random_resized_crop_flip", "scale": [0.6, 1.0], "ratio": [0.75, 1.3333333333333333]}

# The dicts as the backbone modules wrote them before the typed descriptions (copied verbatim).
CIFAR = {"pipeline": "torchvision", "input_size": [3, 32, 32], "resize": [32, 32], "crop": None,
         "interpolation": "bilinear", "to": "float", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
         "train_augment": {"kind": "pad_crop_flip", "padding": 4}}
DIGITNET = {"pipeline": "torchvision", "input_size": [3, 32, 32], "resize": [32, 32], "crop": None,
            "interpolation": "bilinear", "to": "float", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
            "train_augment": {"kind": "affine", "degrees": 10.0, "translate": [0.1, 0.1], "scale": [0.9, 1.1]}}
SUR = {"pipeline": "torchvision", "input_size": [3, 64, 64], "resize": [64, 64], "crop": None,
       "interpolation": "bilinear", "to": "float", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
       "train_augment": MILD, "architecture": "sur-resnet18: conv1 5x5/2 pad 1, no initial max-pool, avgpool 512"}
TFLITE = {"pipeline": "tflite-uint8", "input_size": [3, 224, 224], "resize": [224, 224], "crop": None,
          "interpolation": "bilinear", "to": "uint8_float", "mean": None, "std": None, "train_augment": MILD}


def old_lite0(size: int) -> dict:
    return {"pipeline": "torchvision", "input_size": [3, size, size], "resize": int(math.floor(size / 0.875)),
            "crop": [size, size], "interpolation": "bicubic", "to": "float", "mean": [127 / 255] * 3,
            "std": [128 / 255] * 3, "train_augment": MILD,
            "architecture": "timm tf_efficientnet_lite0 (TF same padding, BN eps 1e-3, ReLU6), lukemelas keys mapped by position"}


def old_minilm(max_length: int, tokenizer_sha256: str) -> dict:
    return {"modality": "text", "tokenizer": "bert-base-uncased WordPiece (tokenizer.json of all-MiniLM-L6-v2)",
            "tokenizer_sha256": tokenizer_sha256, "max_length": int(max_length),
            "padding": "longest, [PAD]=0, attention mask", "pooling": "masked mean", "normalize": "l2",
            "architecture": "BERT 6x384, 12 heads, GELU, LayerNorm eps 1e-12"}


def same_record(new: dict, old: dict) -> None:
    """Equal as the store records and hashes them (canonical JSON: 10 and 10.0 differ)."""
    assert json.dumps(new, sort_keys=True) == json.dumps(old, sort_keys=True)


def test_builtin_descriptions_record_the_dicts_of_before():
    same_record(cifar_resnet.PREPROCESS.as_dict(), CIFAR)
    same_record(sur_resnet.PREPROCESS.as_dict(), SUR)
    same_record(digitnet.PREPROCESS.with_extra(recipe="r", provenance="p").as_dict(),
                dict(DIGITNET, recipe="r", provenance="p"))
    same_record(tflite.PREPROCESS.with_extra(model_file="m.tflite", feature_tensor="output").as_dict(),
                dict(TFLITE, model_file="m.tflite", feature_tensor="output"))
    for size in (224, 160, 97):
        same_record(efficientnet_lite.preprocess(size).as_dict(), old_lite0(size))
    for t in (256, 32):
        same_record(minilm.preprocess(t, "ab" * 32).as_dict(), old_minilm(t, "ab" * 32))


def test_timm_and_torchvision_record_what_they_did():
    cfg = {"input_size": (3, 160, 160), "interpolation": "bicubic", "mean": (0.485, 0.456, 0.406),
           "std": (0.229, 0.224, 0.225), "crop_pct": 0.95, "crop_mode": "center"}
    aug = {"scale": [0.6, 1.0], "ratio": [0.75, 1.3333333333333333], "hflip": 0.5, "color_jitter": None}
    old = {"pipeline": "timm", "timm_version": "1.0", "input_size": [3, 160, 160],
           **{k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items() if k != "input_size"},
           "train_augment": dict(aug)}
    new = TimmPreprocessing(timm_version="1.0", data_config=tuple(cfg.items()), train_augment=tuple(aug.items()))
    same_record(new.as_dict(), old)
    assert new.input_size == (3, 160, 160)
    tv = ImagePreprocessing(input_size=(3, 224, 224), resize=256, crop=(224, 224), interpolation="bilinear",
                            mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                            train_augment=TrainAugment.from_dict(MILD)).with_extra(torchvision_version="0.2")
    same_record(tv.as_dict(), {"pipeline": "torchvision", "torchvision_version": "0.2", "input_size": [3, 224, 224],
                               "resize": 256, "crop": [224, 224], "interpolation": "bilinear", "to": "float",
                               "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "train_augment": MILD})


def test_a_cut_adds_to_the_record_and_a_dict_round_trips():
    cut = cifar_resnet.PREPROCESS.with_extra(cut="layer2", map_shape=[32, 16, 16])
    same_record(cut.as_dict(), dict(CIFAR, cut="layer2", map_shape=[32, 16, 16]))
    assert image_preprocessing(cut.as_dict()) == cut  # the dict gives the description back
    assert ImagePreprocessing.from_dict(CIFAR) == cifar_resnet.PREPROCESS


def test_a_custom_backbones_dict_is_recorded_verbatim():
    given = {"pipeline": "torchvision", "input_size": [3, 8, 8], "resize": [8, 8], "interpolation": "bilinear",
             "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "note": {"a": [1, 2]}}
    net = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    bb = TorchBackbone("dict-net", net, weights_sha256="0" * 64, preprocess=given)
    assert isinstance(bb.preprocessing, RecordedPreprocessing)
    same_record(bb.preprocess, given)  # no train_augment or crop added: its cache keys stay
    from PIL import Image

    x = bb.transform(Image.new("RGB", (20, 12), (255, 0, 0)))
    assert x.shape == (3, 8, 8) and torch.allclose(x[0], torch.ones(8, 8))  # (1 - 0.5) / 0.5


def test_the_transform_follows_the_description():
    from PIL import Image

    img = Image.new("RGB", (40, 40), (10, 200, 30))
    a = build_transform(cifar_resnet.PREPROCESS, train=False)(img)
    b = build_transform(CIFAR, train=False)(img)
    assert a.shape == (3, 32, 32) and torch.equal(a, b)
    uint8 = build_transform(tflite.PREPROCESS, train=False)(img)
    assert uint8.shape == (3, 224, 224) and float(uint8[1].max()) == 200.0


@pytest.mark.parametrize("bad, match", [
    (dict(CIFAR, interpolation="lanczos"), "interpolation 'lanczos'"),
    (dict(CIFAR, to="int"), "to 'int'"),
    ({"input_size": [3, 8, 8]}, "missing resize, interpolation"),
    (dict(CIFAR, train_augment={"kind": "pad_crop_flip", "pad": 4}), r"unknown key\(s\) \['pad'\]"),
])
def test_a_bad_description_is_one_line(bad, match):
    with pytest.raises(UserError, match=match):
        ImagePreprocessing.from_dict(bad)
