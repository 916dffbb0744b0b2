"""CIFAR-10 ResNet-20/32/44/56 (He et al. 2016, Sec. 4.2) with the checkpoints published in
akamaster/pytorch_resnet_cifar10 (BSD-2-Clause).

Architecture: conv1 3x3x16 (no bias) + BN + ReLU; three stages ``layer1..3`` of n basic blocks
(n = 3, 5, 7, 9) with 16/32/64 channels, stride 2 at the first block of stages 2 and 3;
option-A shortcut (parameter-free: ``x[:, :, ::2, ::2]`` plus ``planes // 4`` zero channels
on each side). Global average pooling gives the 64-d feature; the 10-way ``linear``
classifier is present in the checkpoint and dropped here.
Checkpoint layout: ``{"best_prec1": float, "state_dict": {"module.<key>": tensor}}``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from embedcache.backbones import weights as W
from embedcache.backbones.base import TorchBackbone, load_strict, strip_prefix
from embedcache.backbones.preprocessing import ImagePreprocessing, TrainAugment
from embedcache.backbones.registry import register_backbone
from embedcache.errors import UserError

_URL = "https://github.com/akamaster/pytorch_resnet_cifar10/raw/master/pretrained_models/{}"
# Published sha256 of each release file (also in ../shared/README.md).
CHECKPOINTS: dict[int, tuple[str, str]] = {
    20: ("resnet20-12fca82f.th", "12fca82f0bebc4135bf1f32f6e3710e61d5108578464b84fd6d7f5c1b04036c8"),
    32: ("resnet32-d509ac18.th", "d509ac1820d7f25398913559d7e81a13229b1e7adc5648e3bfa5e22dc137f850"),
    44: ("resnet44-014dd654.th", "014dd6541728a1c700b1642ab640e211dc6eb8ed507d70697458dc8f8a0ae2e4"),
    56: ("resnet56-4bfd9763.th", "4bfd97631478d6b638d2764fd2baff3edb1d7d82252d54439343b6596b9b5367"),
}
SUBDIR = "cifar10_resnet"

DECLARES = ("resnet20-cifar10", "resnet32-cifar10", "resnet44-cifar10", "resnet56-cifar10")

PREPROCESS = ImagePreprocessing(
    input_size=(3, 32, 32), resize=(32, 32), mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
    # The augmentation the checkpoints were trained with (pad 4, random 32x32 crop, flip).
    train_augment=TrainAugment("pad_crop_flip", padding=4),
)


class _Block(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.pad = planes // 4 if (stride != 1 or in_planes != planes) else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        short = x
        if self.pad:  # option A: subsample and zero-pad the channels, no parameters
            short = F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))
        return F.relu(out + short)


class CifarResNet(nn.Module):
    """Pooled-feature trunk; parameter names match the published checkpoints."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise UserError(f"resnet{depth}: CIFAR ResNet depth must be 6n+2")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        chans, layers, in_planes = (16, 32, 64), [], 16
        for i, planes in enumerate(chans):
            blocks = []
            for j in range(n):
                blocks.append(_Block(in_planes, planes, 2 if (i > 0 and j == 0) else 1))
                in_planes = planes
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return out.mean(dim=(2, 3))

    def stage_layout(self) -> list[tuple[str, nn.Module]]:
        """Contract 3a layout over this module's own children: stem, layer1..3, pool."""
        from embedcache.backbones.staged import GlobalMean

        return [("stem", nn.Sequential(self.conv1, self.bn1, nn.ReLU())), ("layer1", self.layer1),
                ("layer2", self.layer2), ("layer3", self.layer3), ("pool", GlobalMean())]


def _factory(depth: int):
    name = f"resnet{depth}-cifar10"
    fname, sha = CHECKPOINTS[depth]
    rel = f"{SUBDIR}/{fname}"

    def build(weights_dir: Path | None, device: str) -> TorchBackbone:
        path, digest = W.locate(rel, who=name, weights_dir=weights_dir, sha256=sha, url=_URL.format(fname))
        ckpt = W.load_torch(path, who=name)
        if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
            raise UserError(f"{path}: expected a dict with 'state_dict' (akamaster layout)")
        model = CifarResNet(depth)
        dropped = load_strict(model, strip_prefix(ckpt["state_dict"], "module."), who=name, ignore=("linear.",))
        if dropped != ["linear.bias", "linear.weight"]:
            raise UserError(f"{path}: expected the 10-way 'linear' classifier in the checkpoint, found {dropped}")
        return TorchBackbone(name, model, weights_sha256=digest, preprocess=PREPROCESS, device=device)

    def probe(weights_dir: Path | None) -> tuple[bool, str]:
        p = W.find_file(rel, weights_dir)
        if p is not None:
            return True, str(p)
        return False, f"not found in {W.looked_in(rel, weights_dir)}; downloadable from {_URL.format(fname)}"

    return name, build, probe


for _depth in CHECKPOINTS:
    _name, _build, _probe = _factory(_depth)
    register_backbone(
        _name, _build, probe=_probe, source="cifar-resnet", feature_dim=64,
        cut_points=("stem", "layer1", "layer2", "layer3"),
        description=f"ResNet-{_depth} (CIFAR variant, option-A shortcut) trained on CIFAR-10; "
                    "akamaster/pytorch_resnet_cifar10 release; 64-d pooled feature, 32x32 input",
    )
