"""One registry of backbone factories (the timm pattern: ``register_model`` / ``create_model``).

Fixed names (``resnet20-cifar10``, ``resnet18-quickdraw``, ``digitnet-builtin``...) are
registered by the source modules; three open families are resolved by prefix:
``timm:<model>`` (any timm model), ``tv:<model>`` (any torchvision classification model) and
``ckpt:<path>`` (a fine-tuned checkpoint of any of them, written by fedheads; contract 3f).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from embedcache.backbones.base import Backbone
from embedcache.errors import UserError

Factory = Callable[[Path | None, str], Backbone]
"""``factory(weights_dir, device) -> Backbone``; weights_dir None means "resolve the default"."""
Probe = Callable[[Path | None], tuple[bool, str]]
"""``probe(weights_dir) -> (available, reason)`` without building the model or downloading."""


@dataclass(frozen=True)
class BackboneInfo:
    """One row of :func:`list_backbones`."""

    name: str  # registry name, or a family pattern such as "timm:<model>"
    description: str  # one line: architecture, pre-training data, provenance
    available: bool  # weights found locally (or buildable without a download)
    reason: str  # where the weights are / why not available
    source: str = ""  # "cifar-resnet", "sur-resnet18", "tflite", "builtin", "timm", "torchvision"
    feature_dim: int | None = None  # pooled dimension when known without building the model
    trainable: bool | None = None  # Backbone.trainable() works (None: depends on the model)
    cut_points: tuple[str, ...] = ()  # names usable as <name>@<cut> / --cut (contract 3a)
    modality: str = "image"  # "image" | "text" (what embed() takes, contract 3d)


@dataclass(frozen=True)
class _Entry:
    factory: Factory
    description: str
    probe: Probe | None
    source: str
    feature_dim: int | None
    cut_points: tuple[str, ...] | None
    modality: str


_REGISTRY: dict[str, _Entry] = {}
_FAMILIES = ("timm:", "tv:", "ckpt:")


def register_backbone(name: str, factory: Factory, *, description: str, probe: Probe | None = None,
                      source: str = "", feature_dim: int | None = None,
                      cut_points: tuple[str, ...] | None = None, modality: str = "image") -> None:
    """Register ``factory`` under ``name``; re-registering a name replaces it (last wins).

    ``cut_points``: the StagedNet's cut points, listed without building the model (``()`` for a
    backbone that cannot be fine-tuned, None when unknown). ``modality``: "image" or "text"."""
    if not name or name.startswith(_FAMILIES) or "@" in name or any(c.isspace() for c in name):
        raise UserError(f"{name!r}: not a valid backbone name")
    if modality not in ("image", "text"):
        raise UserError(f"{name}: modality {modality!r} must be image or text")
    _REGISTRY[name] = _Entry(factory, description, probe, source, feature_dim,
                             None if cut_points is None else tuple(cut_points), modality)


def _ensure_loaded() -> None:
    # Importing the source modules registers their names; kept lazy so that importing the
    # registry alone stays cheap.
    from embedcache.backbones import cifar_resnet, digitnet, efficientnet_lite, minilm, sur_resnet, tflite  # noqa: F401


def registered_names() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def create_backbone(name: str, *, weights_dir: str | os.PathLike | None = None, device: str = "cpu") -> Backbone:
    """Build the backbone ``name`` with weights from ``weights_dir`` (or the default resolution);
    ``<name>@<cut>`` builds the cut backbone (contract 3b)."""
    _ensure_loaded()
    from embedcache.backbones.cut import CutBackbone, split_cut

    base, cut = split_cut(name)
    if cut is not None:
        base_bb = create_backbone(base, weights_dir=weights_dir, device="cpu")
        own = getattr(base_bb, "cut_backbone", None)  # text backbones cut their own token states
        if callable(own):
            return own(cut, device=device)
        return CutBackbone(base_bb, cut, device=device)
    wd = Path(weights_dir) if weights_dir is not None else None
    if name.startswith("timm:"):
        from embedcache.backbones.timm_tv import create_timm

        return create_timm(name[len("timm:"):], wd, device)
    if name.startswith("ckpt:"):
        from embedcache.backbones.ckpt import create_ckpt

        return create_ckpt(name, wd, device)
    if name.startswith("tv:"):
        from embedcache.backbones.timm_tv import create_tv

        return create_tv(name[len("tv:"):], wd, device)
    if name.startswith("efficientnet-lite0:"):
        from embedcache.backbones.efficientnet_lite import create_sized

        return create_sized(name, wd, device)
    if name.startswith("minilm-l6-v2:"):
        from embedcache.backbones.minilm import create_sized as create_minilm_sized

        return create_minilm_sized(name, wd, device)
    if name not in _REGISTRY:
        from embedcache.backbone_names import unknown_backbone

        raise unknown_backbone(name, list(_REGISTRY))
    bb = _REGISTRY[name].factory(wd, device)
    if bb.name != name:
        raise UserError(f"{name}: factory returned a backbone named {bb.name!r}")
    return bb


def list_backbones(weights_dir: str | os.PathLike | None = None) -> list[BackboneInfo]:
    """Every registered backbone with its availability, then the open families (timm:, tv:, ckpt:)."""
    _ensure_loaded()
    wd = Path(weights_dir) if weights_dir is not None else None
    rows = []
    for name in sorted(_REGISTRY):
        e = _REGISTRY[name]
        ok, why = e.probe(wd) if e.probe else (True, "no weights file needed")
        trainable = None if e.cut_points is None else bool(e.cut_points)
        rows.append(BackboneInfo(name, e.description, ok, why, e.source, e.feature_dim, trainable, e.cut_points or (),
                                 e.modality))
    from embedcache.backbones.timm_tv import family_rows

    rows.extend(family_rows(wd))
    rows.append(BackboneInfo("ckpt:<path>", "a fine-tuned checkpoint of any backbone (fedheads finetune writes "
                             "RUN_DIR/state/seed<S>.backbone.pt)", True,
                             "the file names its base backbone, whose weights must be found", "checkpoint", None))
    return rows


def default_backbones_with_reason(weights_dir: str | os.PathLike | None = None) -> tuple[list[str], str]:
    """Backbones to use when the user names none: the real CIFAR ResNet-20 if its weights are
    present, else the locally pre-trained ``digitnet-builtin``; returns (names, reason)."""
    _ensure_loaded()
    wd = Path(weights_dir) if weights_dir is not None else None
    ok, why = _REGISTRY["resnet20-cifar10"].probe(wd)  # type: ignore[misc]
    if ok:
        return ["resnet20-cifar10"], f"resnet20-cifar10 weights found ({why})"
    return ["digitnet-builtin"], f"resnet20-cifar10 unavailable ({why}); using digitnet-builtin"


def default_backbones(weights_dir: str | os.PathLike | None = None) -> list[str]:
    """``["resnet20-cifar10"]`` if its weights are found, else ``["digitnet-builtin"]``
    (the reason is logged; see :func:`default_backbones_with_reason`)."""
    names, reason = default_backbones_with_reason(weights_dir)
    logging.getLogger(__name__).info("default backbones %s: %s", names, reason)
    return names
