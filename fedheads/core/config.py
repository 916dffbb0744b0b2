"""Settings as dataclass fields that carry their own documentation.

Each field of an algorithm's config dataclass, and of every command's options, is declared with
:func:`setting`, which records its one-line doc and the paper passage it comes from in the field's
metadata. `--set`, `--config`, `--dump-config`, `fedheads algorithms NAME`, the command-line
flags, the Python API's keyword checks and the documentation read them from there, so a new
setting is shown, settable and documented without touching any other file::

    @dataclass(frozen=True)
    class Fed3RConfig:
        lam: float = setting(0.01, "ridge penalty lambda", source="Fed3R Sec. 3, Eq. 4")

Standard library only: the command line reads these fields before it imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

_MISSING: Any = dataclasses.MISSING


def setting(default: Any = _MISSING, doc: str = "", *, source: str = "", default_factory: Callable[[], Any] = _MISSING,
            **flag: Any) -> Any:
    """A field with its doc and paper source (give `default` or `default_factory`). `flag`: what a
    command-line option needs beyond that (fedheads.run.options reads it): ``choices`` (a tuple),
    ``short`` ("-o"), ``metavar``, ``name`` (the option's name when it is not the field's),
    ``required`` (on the command line), ``negate`` (a flag that sets the field False: --quiet for
    progress), ``operational`` (how to run, not what: never in a config file), ``cli=False`` (a
    keyword of the Python API only), ``inline`` / ``prefix`` (a nested options object whose fields
    are options of their own, under `prefix`- when given), ``multiple`` (repeatable: --set)."""
    meta = {"doc": doc, "source": source, **flag}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def setting_doc(f: dataclasses.Field) -> tuple[str, str]:
    """(doc, source) recorded by :func:`setting` ("" where the field has none)."""
    return str(f.metadata.get("doc", "")), str(f.metadata.get("source", ""))
