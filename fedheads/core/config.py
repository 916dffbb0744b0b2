"""Algorithm settings as dataclass fields that carry their own documentation.

Each field of an algorithm's config dataclass is declared with :func:`setting`, which records
its one-line doc and the paper passage it comes from in the field's metadata. `--set`,
`--config`, `--dump-config` and `fedheads algorithms NAME` read them from there, so a new
algorithm's settings are shown and settable without touching any other file::

    @dataclass(frozen=True)
    class Fed3RConfig:
        lam: float = setting(0.01, "ridge penalty lambda", source="Fed3R Sec. 3, Eq. 4")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

_MISSING: Any = dataclasses.MISSING


def setting(default: Any = _MISSING, doc: str = "", *, source: str = "",
            default_factory: Callable[[], Any] = _MISSING) -> Any:
    """A config field with its doc and paper source (give `default` or `default_factory`)."""
    meta = {"doc": doc, "source": source}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def setting_doc(f: dataclasses.Field) -> tuple[str, str]:
    """(doc, source) recorded by :func:`setting` ("" where the field has none)."""
    return str(f.metadata.get("doc", "")), str(f.metadata.get("source", ""))
