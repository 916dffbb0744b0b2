"""`--plugin MODULE` (`embedcache extract`, `fedheads`; also `$FEDHEADS_PLUGINS`): import user
modules before a command runs, so that what they register (backbones, `fedheads.register_algorithm`
algorithms, docs/custom_algorithm.md) is usable from the command line like the built-in ones.
Standard library only: extraction workers and `fedheads` import it."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from embedcache.errors import UserError

FEDHEADS_ENV = "FEDHEADS_PLUGINS"


def plugin_names(flags: Iterable[str] = (), env: str | None = None) -> list[str]:
    """Module names from `env` (the value of e.g. `$FEDHEADS_PLUGINS`: comma- or space-separated)
    then the flags, each once."""
    raw = env or ""
    out: list[str] = []
    for name in [*raw.replace(",", " ").split(), *flags]:
        name = name.strip()
        if name and name not in out:
            out.append(name)
    return out


def import_plugins(names: Iterable[str]) -> list[str]:
    """Import each module; a module that cannot be imported is one UserError naming it.

    The current directory is searched last (a console script does not put it on sys.path, unlike
    `python -m`), so a module next to the user's data is found without shadowing installed ones."""
    names = list(names)
    cwd = str(Path.cwd())
    if names and cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    for name in names:
        if name.endswith(".py") or not all(part.isidentifier() for part in name.split(".")):
            raise UserError(f"plugin {name!r}: not a module name (e.g. mypkg.algs for mypkg/algs.py; "
                            "put its directory on PYTHONPATH or run from it)")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing = f"no module named {exc.name!r}" if exc.name else str(exc)
            raise UserError(f"plugin {name}: cannot import it ({missing}; is it on PYTHONPATH?)") from None
        except Exception as exc:  # the plugin's own code failed while importing
            if os.environ.get("FEDFROZEN_DEBUG", "").strip() not in ("", "0"):  # cli_base.DEBUG_ENV
                raise
            msg = " ".join(str(exc).split()) or "(no message)"
            raise UserError(f"plugin {name}: importing it failed ({type(exc).__name__}: {msg})") from None
    return names
