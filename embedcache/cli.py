"""`embedcache` command line. Each sub-command lives in `embedcache/commands/<name>.py`
and imports torch/timm/dask lazily, so `embedcache --help` is instant."""

from __future__ import annotations

import click

from embedcache.cli_base import UserErrorGroup
from embedcache.version import __version__


@click.group(cls=UserErrorGroup)
@click.version_option(__version__, prog_name="embedcache")
def main() -> None:
    """Cache frozen-backbone features per client and domain as Zarr shards."""


def _register() -> None:
    from embedcache.commands import backbones, extract, partition, store

    main.add_command(partition.partition)
    main.add_command(backbones.backbones)
    main.add_command(extract.extract)
    for cmd in store.COMMANDS:
        main.add_command(cmd)


_register()

if __name__ == "__main__":  # pragma: no cover
    main()
