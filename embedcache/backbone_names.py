"""The built-in backbone names, known without importing torch: the command lines check a name
here before they load torch, timm or dask, so a typo is refused at once with the nearest name.
tests/test_checks.py checks that BUILTIN equals the registry's names (embedcache.backbones) and
FAMILIES its open families. A backbone a plugin registers is known once its module is imported:
the registry itself is asked then (torch is loaded by then anyway)."""

from __future__ import annotations

import sys

from embedcache.errors import UserError, did_you_mean

BUILTIN = ("digitnet-builtin", "efficientnet-lite0", "minilm-l6-v2", "mobilenet-v1-embed-tflite",
           "mobilenet-v2-tflite", "resnet18-aircraft", "resnet18-birds", "resnet18-quickdraw", "resnet20-cifar10",
           "resnet32-cifar10", "resnet44-cifar10", "resnet56-cifar10")
FAMILIES = ("timm:", "tv:", "ckpt:")  # resolved by prefix: timm:<model>, tv:<model>, ckpt:<path>
SIZED = ("efficientnet-lite0:", "minilm-l6-v2:")  # <name>:<px> / <name>:<tokens>


def unknown_backbone(name: str, known: list[str]) -> UserError:
    """The one line for a backbone name nothing registers, with the nearest known name."""
    known = sorted(known)
    return UserError(f"{name}: unknown backbone{did_you_mean(name, known)} (known: {', '.join(known)}, timm:<model>, tv:<model>, "
                     "ckpt:<path>)")


def check_backbone_name(name: str) -> None:
    """UserError when `name` (optionally cut, `<name>@<cut>`) is no built-in or registered
    backbone and no open family; the cut itself is checked when the backbone is built."""
    base = name.rsplit("@", 1)[0] if "@" in name else name
    if not base or base.startswith(FAMILIES + SIZED):
        return
    if "embedcache.backbones.registry" in sys.modules:  # a plugin may have registered more
        from embedcache.backbones.registry import registered_names

        known = registered_names()
    else:
        known = list(BUILTIN)
    if base not in known:
        raise unknown_backbone(base, known)
