"""embedcache: run frozen backbones once over every client's images and keep the
features as keyed, resumable Zarr shards (one per backbone x client x split)."""

__version__ = "0.1.0"
