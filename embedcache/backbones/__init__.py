"""Backbone registry and sources (contract: docs/contracts.md section 3).

``create_backbone(name)`` builds one of: ``resnet{20,32,44,56}-cifar10``,
``resnet18-{quickdraw,aircraft,birds}``, ``mobilenet-v1-embed-tflite``, ``mobilenet-v2-tflite``,
``digitnet-builtin``, ``efficientnet-lite{0,1,2}[:<px>]``, the text encoder ``minilm-l6-v2[:<T>]``
(``modality = "text"``), ``timm:<model>``, ``tv:<model>``, ``ckpt:<path>``, and any of them cut after a
stage as ``<name>@<cut>``. Each backbone module registers its names (``register_backbone``) and
families (``register_family``) and declares them in ``DECLARES``; see it for the architecture,
checkpoint layout and preprocessing (``embedcache.backbones.preprocessing``) it assumes;
``Backbone.trainable()`` gives a StagedNet.
"""

from embedcache.backbones.base import Backbone
from embedcache.backbones.preprocessing import ImagePreprocessing, Preprocessing, TextPreprocessing, TrainAugment
from embedcache.backbones.registry import (
    BackboneInfo,
    create_backbone,
    default_backbones,
    default_backbones_with_reason,
    list_backbones,
    register_backbone,
    register_family,
    registered_names,
)
from embedcache.backbones.staged import StagedNet
from embedcache.backbones.weights import resolve_weights_dir

__all__ = [
    "Backbone",
    "BackboneInfo",
    "ImagePreprocessing",
    "Preprocessing",
    "TextPreprocessing",
    "TrainAugment",
    "create_backbone",
    "default_backbones",
    "default_backbones_with_reason",
    "list_backbones",
    "register_backbone",
    "register_family",
    "registered_names",
    "resolve_weights_dir",
    "StagedNet",
]
