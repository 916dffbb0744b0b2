"""`embedcache` command line. Each sub-command lives in `embedcache/commands/<name>.py`
and imports torch/timm/dask lazily, so `embedcache --help` is instant."""

from __future__ import annotations

import sys

import click

from embedcache import __version__
from embedcache.errors import UserError


class _Group(click.Group):
    """Turns a `UserError` anywhere below into one line on stderr and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
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
