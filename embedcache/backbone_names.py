"""The built-in backbone names, known without importing torch: the command lines check a name
here before they load torch, timm or dask, so a typo is refused at once with the nearest name.

Each backbone module of `embedcache.backbones` declares what it registers in a literal
``DECLARES = (...)``: names (``resnet20-cifar10``) and family patterns (``timm:<model>``, whose
prefix is the part before ``<``). They are read from the source files without importing them;
the registry imports exactly those modules, and a contract test checks that each registers what it
declares. Installed packages add theirs as entry points of the group `embedcache.backbones`,
named after what they register (read from the packages' metadata, nothing imported). A
backbone a `--plugin` module registers is known once it is imported: the registry itself is
asked then (torch is loaded by then anyway)."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

from embedcache.errors import UserError, did_you_mean

PACKAGE = "embedcache.backbones"
_DIR = Path(__file__).resolve().parent / "backbones"


@functools.cache
def declarations() -> dict[str, tuple[str, ...]]:
    """{module: its DECLARES} for every module of the backbones package that has one."""
    out: dict[str, tuple[str, ...]] = {}
    for f in sorted(_DIR.glob("*.py")):
        text = f.read_text(encoding="utf-8")
        if "\nDECLARES = " not in text:
            continue
        for node in ast.parse(text, str(f)).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "DECLARES"):
                out[f"{PACKAGE}.{f.stem}"] = tuple(ast.literal_eval(node.value))
    return out


def builtin_modules() -> list[str]:
    """The modules that register the built-in backbones, in file-name order."""
    return list(declarations())


GROUP = "embedcache.backbones"  # the entry point group of installed backbone plugins


@functools.cache
def installed() -> tuple[str, ...]:
    """The names installed packages declare in the entry point group `embedcache.backbones`: each
    entry point is named after the backbone it registers (``my-net = "mypkg.backbones"``) or its
    family's pattern (``"myfam:<model>" = ...``), so those names too are known before torch loads."""
    from importlib.metadata import entry_points

    return tuple(ep.name for ep in entry_points(group=GROUP))


def _all() -> list[str]:
    return [n for names in declarations().values() for n in names] + list(installed())


def builtin_names() -> list[str]:
    """The built-in backbone names (families aside), sorted."""
    return sorted(n for n in _all() if "<" not in n)


def family_patterns() -> list[str]:
    """The built-in families as patterns, e.g. ``timm:<model>``."""
    return [n for n in _all() if "<" in n]


def family_prefixes() -> tuple[str, ...]:
    return tuple(p.split("<", 1)[0] for p in family_patterns())


def unknown_backbone(name: str, known: list[str], prefixes: list[str] | None = None) -> UserError:
    """The one line for a backbone name nothing registers, with the nearest known name."""
    known = sorted(known)
    patterns = [p for p in family_patterns() if prefixes is None or p.split("<", 1)[0] in prefixes]
    patterns += [f"{p}<...>" for p in prefixes or () if p not in family_prefixes()]
    return UserError(f"{name}: unknown backbone{did_you_mean(name, known)} (known: {', '.join(known + patterns)})")


def check_backbone_name(name: str) -> None:
    """UserError when `name` (optionally cut, `<name>@<cut>`) is no built-in or registered
    backbone and no family; the cut itself is checked when the backbone is built."""
    base = name.rsplit("@", 1)[0] if "@" in name else name
    registry = sys.modules.get(f"{PACKAGE}.registry")  # loaded: a plugin may have registered more
    prefixes = tuple(registry.registered_families()) if registry else family_prefixes()
    if not base or base.startswith(prefixes):
        return
    known = registry.registered_names() if registry else builtin_names()
    if base not in known:
        raise unknown_backbone(base, known, list(prefixes))
