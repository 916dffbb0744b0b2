"""One registry of backbone factories (the timm pattern: ``register_model`` / ``create_model``).

Two kinds of entries:
- a name (``resnet20-cifar10``, ``digitnet-builtin``...): ``register_backbone(name, factory, ...)``,
  ``factory(weights_dir, device) -> Backbone``;
- a family, every name that starts with a prefix (``timm:<model>``, ``tv:<model>``,
  ``ckpt:<path>``, ``efficientnet-lite0:<px>``...): ``register_family(prefix, factory, ...)``,
  ``factory(name, weights_dir, device) -> Backbone``.

The registry names no backbone module. The built-in ones are the modules of this package that
declare what they register in a literal ``DECLARES = (...)`` (read without importing them by
`embedcache.backbone_names`, so that the command lines refuse a typo before torch loads);
installed packages add theirs through the ``embedcache.backbones`` entry-point group, and
``--plugin MODULE`` imports a module that registers. A new backbone or family is one file.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from embedcache.backbone_names import GROUP as ENTRY_POINTS  # the group of installed backbone plugins
from embedcache.backbone_names import builtin_modules, family_prefixes, unknown_backbone
from embedcache.backbones.base import Backbone
from embedcache.errors import UserError

Factory = Callable[[Path | None, str], Backbone]
"""``factory(weights_dir, device) -> Backbone``; weights_dir None means "resolve the default"."""
FamilyFactory = Callable[[str, Path | None, str], Backbone]
"""``factory(name, weights_dir, device) -> Backbone`` for a name of the family (prefix included)."""
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


@dataclass(frozen=True)
class _Family:
    factory: FamilyFactory
    rows: Callable[[Path | None], list[BackboneInfo]] | None  # what `embedcache backbones` lists for it


_REGISTRY: dict[str, _Entry] = {}
_FAMILIES: dict[str, _Family] = {}
_LOADED: list[bool] = []


def _check_free(name: str) -> None:
    if not name or "@" in name or any(c.isspace() for c in name):
        raise UserError(f"{name!r}: not a valid backbone name")


def register_backbone(name: str, factory: Factory, *, description: str, probe: Probe | None = None,
                      source: str = "", feature_dim: int | None = None,
                      cut_points: tuple[str, ...] | None = None, modality: str = "image") -> None:
    """Register ``factory`` under ``name``; re-registering a name replaces it (last wins).

    ``cut_points``: the StagedNet's cut points, listed without building the model (``()`` for a
    backbone that cannot be fine-tuned, None when unknown). ``modality``: "image" or "text"."""
    _check_free(name)
    owner = next((p for p in (*_FAMILIES, *family_prefixes()) if name.startswith(p)), None)
    if owner is not None:
        raise UserError(f"{name!r}: not a valid backbone name (the family {owner} owns it)")
    if modality not in ("image", "text"):
        raise UserError(f"{name}: modality {modality!r} must be image or text")
    _REGISTRY[name] = _Entry(factory, description, probe, source, feature_dim,
                             None if cut_points is None else tuple(cut_points), modality)


def register_family(prefix: str, factory: FamilyFactory, *,
                    rows: Callable[[Path | None], list[BackboneInfo]] | None = None) -> None:
    """Every name that starts with ``prefix`` (which ends in ``:``) is built by ``factory(name,
    weights_dir, device)``; ``rows(weights_dir)`` gives the family's lines of `embedcache backbones`
    (its pattern, local checkpoints...). Re-registering a prefix replaces it."""
    _check_free(prefix)
    if not prefix.endswith(":"):
        raise UserError(f"{prefix!r}: a family prefix ends in ':' (e.g. timm:)")
    _FAMILIES[prefix] = _Family(factory, rows)


def family_of(name: str) -> str | None:
    """The registered prefix that ``name`` starts with, if any."""
    return next((p for p in _FAMILIES if name.startswith(p)), None)


def _ensure_loaded() -> None:
    # Importing a backbone module registers its names; done once, on first use, so that
    # importing the registry alone stays cheap.
    if _LOADED:
        return
    _LOADED.append(True)
    for module in builtin_modules():
        importlib.import_module(module)
    for ep in entry_points(group=ENTRY_POINTS):
        try:
            ep.load()
        except Exception as exc:  # a broken third-party package: one line naming it
            raise UserError(f"entry point {ep.name} ({ep.value}) of {ENTRY_POINTS}: cannot be loaded "
                            f"({type(exc).__name__}: {exc})") from None


def registered_names() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def registered_families() -> list[str]:
    _ensure_loaded()
    return list(_FAMILIES)


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
    prefix = family_of(name)
    if prefix is not None:
        return _FAMILIES[prefix].factory(name, wd, device)
    if name not in _REGISTRY:
        raise unknown_backbone(name, list(_REGISTRY), list(_FAMILIES))
    bb = _REGISTRY[name].factory(wd, device)
    if bb.name != name:
        raise UserError(f"{name}: factory returned a backbone named {bb.name!r}")
    return bb


def list_backbones(weights_dir: str | os.PathLike | None = None) -> list[BackboneInfo]:
    """Every registered backbone with its availability, then the families' rows."""
    _ensure_loaded()
    wd = Path(weights_dir) if weights_dir is not None else None
    rows = []
    for name in sorted(_REGISTRY):
        e = _REGISTRY[name]
        ok, why = e.probe(wd) if e.probe else (True, "no weights file needed")
        trainable = None if e.cut_points is None else bool(e.cut_points)
        rows.append(BackboneInfo(name, e.description, ok, why, e.source, e.feature_dim, trainable, e.cut_points or (),
                                 e.modality))
    for family in _FAMILIES.values():
        if family.rows is not None:
            rows.extend(family.rows(wd))
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
