"""embedcache: run frozen backbones once over every client's images and keep the
features as keyed, resumable Zarr shards (one per backbone x client x split).

Python API (one function per command, see embedcache.api): `partition`, `extract`,
`open_store`, `load_split`, `import_features`, `export`."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from embedcache.api import export, import_features, load_split, open_store  # noqa: E402

__all__ = ["export", "extract", "import_features", "load_split", "open_store", "partition", "__version__"]


def __getattr__(name: str) -> Any:
    # `embedcache.partition` / `embedcache.extract` are modules that are also callable as the API
    # functions of the same name (embedcache.callable_module): imported on first use, so
    # `import embedcache` (and every CLI start) stays light
    if name in ("partition", "extract"):
        return importlib.import_module(f"embedcache.{name}")
    raise AttributeError(f"module 'embedcache' has no attribute {name!r}")
