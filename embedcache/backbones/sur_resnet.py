"""The Meta-Dataset ResNet-18 backbones of SUR / URL (Dvornik et al. 2020; Li et al. 2021)
that FedPCL uses (Tan et al. 2022, Sec. 5.1 and Appendix A.1.3: "ResNet18 pre-trained on
Quick Draw, Aircraft, and CU-Birds", 512-d output each).

Files: ``<weights_dir>/{quickdraw,aircraft,cu_birds}-net/model_best.pth.tar``, the layout of
the SUR release and of FedPCL's ``lib/models/weights/<ds>-net/``. Each is a dict with a
``state_dict`` entry (other entries such as ``epoch`` or ``optimizer`` are ignored); keys may
carry a ``module.`` prefix (DataParallel); the dataset classifier (``cls_fn.*`` in SUR/URL,
``fc.*`` in a torchvision-style save) is dropped. Every remaining key must match.

Architecture assumed (SUR/URL ``models/resnet18.py``): conv1 5x5, 64 channels, stride 2,
padding 1, no bias; BN; ReLU; **no initial max-pool** (SUR sets ``initial_pool = False``, so the
weights were trained without it); four stages of two BasicBlocks (64/128/256/512, stride 2
from stage 2 on, 1x1-conv+BN downsample, keys ``layerN.0.downsample.{0,1}``); global average
pool -> 512-d. FedPCL's port always applies the max-pool (its forward ignores
``initial_pool``) and then L2-normalises over a size-1 axis; we follow the training code and
return the raw pooled feature (normalisation is the head's business). ``initial_pool=True``
reproduces FedPCL's trunk.

Preprocessing: resize to 64x64 as FedPCL does for its data, ToTensor, Normalize(0.5, 0.5)
i.e. [-1, 1], the range of Meta-Dataset images the backbones were trained on (FedPCL uses it
for digits; it feeds Office in [0, 1], a mismatch we do not copy).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from embedcache.backbones import weights as W
from embedcache.backbones.base import TorchBackbone, load_strict, strip_prefix
from embedcache.backbones.preprocessing import MILD_CROP, ImagePreprocessing
from embedcache.backbones.registry import register_backbone
from embedcache.errors import UserError

DATASETS = {"quickdraw": "quickdraw", "aircraft": "aircraft", "birds": "cu_birds"}
"""registry suffix -> weights sub-directory prefix (``<prefix>-net``)."""

DECLARES = ("resnet18-aircraft", "resnet18-birds", "resnet18-quickdraw")

PREPROCESS = ImagePreprocessing(
    input_size=(3, 64, 64), resize=(64, 64), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), train_augment=MILD_CROP,
).with_extra(architecture="sur-resnet18: conv1 5x5/2 pad 1, no initial max-pool, avgpool 512")


class _Basic(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class SurResNet18(nn.Module):
    """SUR/URL ResNet-18 trunk; parameter names match their checkpoints."""

    def __init__(self, initial_pool: bool = False) -> None:
        super().__init__()
        self.initial_pool = initial_pool
        self.conv1 = nn.Conv2d(3, 64, kernel_size=5, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes, stages = 64, []
        for i, planes in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(_Basic(inplanes, planes, stride), _Basic(planes, planes, 1)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        if self.initial_pool:
            x = self.maxpool(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return x.mean(dim=(2, 3))

    def stage_layout(self) -> list[tuple[str, nn.Module]]:
        """Contract 3a layout over this module's own children: stem, layer1..4, pool."""
        from embedcache.backbones.staged import GlobalMean

        stem = [self.conv1, self.bn1, self.relu] + ([self.maxpool] if self.initial_pool else [])
        return ([("stem", nn.Sequential(*stem))] + [(f"layer{i}", getattr(self, f"layer{i}")) for i in range(1, 5)]
                + [("pool", GlobalMean())])


def load_sur_checkpoint(path: Path, model: SurResNet18, *, who: str) -> list[str]:
    """Strictly load a SUR-format checkpoint into ``model``; returns the dropped classifier keys."""
    ckpt = W.load_torch(path, who=who)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise UserError(f"{path}: expected a dict with a 'state_dict' entry (SUR/URL layout)")
    state = strip_prefix(ckpt["state_dict"], "module.")
    return load_strict(model, state, who=f"{who} ({path})", ignore=("cls_fn.", "fc."))


def _factory(suffix: str, prefix: str):
    name = f"resnet18-{suffix}"
    rel = f"{prefix}-net/model_best.pth.tar"

    def build(weights_dir: Path | None, device: str) -> TorchBackbone:
        # No public direct URL (the SUR release is a Google Drive archive): local files only.
        path, digest = W.locate(rel, who=name, weights_dir=weights_dir)
        model = SurResNet18(initial_pool=False)
        load_sur_checkpoint(path, model, who=name)
        return TorchBackbone(name, model, weights_sha256=digest, preprocess=PREPROCESS, device=device)

    def probe(weights_dir: Path | None) -> tuple[bool, str]:
        p = W.find_file(rel, weights_dir)
        if p is not None:
            return True, str(p)
        return False, (f"not found in {W.looked_in(rel, weights_dir)} (get it from the SUR/URL "
                       "Meta-Dataset release, e.g. via the FedPCL README)")

    return name, build, probe


for _suffix, _prefix in DATASETS.items():
    _name, _build, _probe = _factory(_suffix, _prefix)
    register_backbone(
        _name, _build, probe=_probe, source="sur-resnet18", feature_dim=512,
        cut_points=("stem", "layer1", "layer2", "layer3", "layer4"),
        description=f"ResNet-18 (SUR/URL, conv1 5x5/2) pre-trained on Meta-Dataset {_prefix}; "
                    "backbone of FedPCL; 512-d pooled feature, 64x64 input in [-1, 1]",
    )
