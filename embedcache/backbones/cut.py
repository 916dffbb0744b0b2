"""Cut backbones ``<backbone>@<cut>`` (docs/contracts.md section 3b): the activation map after a
stage, flattened, as a Backbone, so that `embedcache extract` caches it like any feature and
fine-tuning can train the stages after the cut without a live pass through the frozen prefix.
"""

from __future__ import annotations

import torch
from torch import nn

from embedcache.backbones.base import Backbone, CpuChannelsLastBackbone, TorchBackbone
from embedcache.backbones.preprocessing import preprocessing_of
from embedcache.errors import UserError


def split_cut(name: str) -> tuple[str, str | None]:
    """``"resnet20-cifar10@layer2"`` -> ``("resnet20-cifar10", "layer2")``; no ``@``: cut None."""
    if "@" not in name:
        return name, None
    base, cut = name.rsplit("@", 1)
    if not base or not cut:
        raise UserError(f"{name}: a cut backbone is named <backbone>@<cut>, e.g. resnet20-cifar10@layer2")
    return base, cut


def with_cut(names: tuple[str, ...], cut: str | None) -> tuple[str, ...]:
    """Apply ``--cut`` to every backbone name (a name that already has one is an error)."""
    if not cut:
        return names
    clash = [n for n in names if "@" in n]
    if clash:
        raise UserError(f"{clash[0]}: already names a cut; drop --cut {cut} or the @ part")
    return tuple(f"{n}@{cut}" for n in names)


class CutBackbone(CpuChannelsLastBackbone):
    """``embed`` = the base's stages up to and including ``cut``, flattened to [B, C*H*W]."""

    def __init__(self, base: Backbone, cut: str, *, device: str = "cpu") -> None:
        if not callable(getattr(base, "trainable", None)):  # a duck-typed plugin backbone
            raise UserError(f"{base.name}: cannot be fine-tuned (it has no trainable())")
        staged = base.trainable()  # a UserError for backbones that cannot train (TFLite)
        if cut not in staged.cut_points():
            points = ", ".join(staged.cut_points()) or "none (the network is one stage)"
            raise UserError(f"{base.name}@{cut}: {base.name} has no cut point {cut!r}; cut points: {points}")
        names = staged.stage_names[: staged.stage_names.index(cut) + 1]
        prefix = nn.Sequential(*(staged.stage(n) for n in names))
        self.base_name, self.cut = base.name, cut
        self.map_shape = tuple(staged.stage_output_shape(cut))
        self.cpu_channels_last = bool(getattr(base, "cpu_channels_last", False))
        # A base built from its preprocessing description gets the same pipeline from the extended one;
        # a base with its own transform (timm) lends it without keeping its frozen module alive.
        transform_fn = base._transform_fn if isinstance(base, TorchBackbone) else _BoundTransform(base)
        preprocess = preprocessing_of(base).with_extra(cut=cut, map_shape=list(self.map_shape))
        super().__init__(f"{base.name}@{cut}", prefix, weights_sha256=base.weights_sha256, preprocess=preprocess,
                         device=device, transform_fn=transform_fn)

    def trainable(self):
        raise UserError(f"{self.name}: a cut backbone only extracts maps; fine-tune {self.base_name} "
                        f"(its StagedNet runs from the cached map with forward(x, start={self.cut!r}))")


class _BoundTransform:
    def __init__(self, base: Backbone) -> None:
        self.base = base

    def __call__(self, img, train: bool) -> torch.Tensor:
        return self.base.transform(img, train=train)

