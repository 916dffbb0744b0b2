"""embedcache: run frozen backbones once over every client's images and keep the
features as keyed, resumable Zarr shards (one per backbone x client x split).

Python API (one function per command, see embedcache.api): `partition`, `extract`,
`open_store`, `load_split`, `import_features`, `export`. Nothing heavy is imported until one
of them runs, so `import embedcache` (and every CLI start) stays light."""

from __future__ import annotations

from embedcache.api import export, extract, import_features, load_split, open_store, partition
from embedcache.version import __version__

__all__ = ["export", "extract", "import_features", "load_split", "open_store", "partition", "__version__"]
