"""`fedheads` command line (train / compare / predict)."""

from __future__ import annotations

import sys

import click

from fedheads import __version__
from embedcache.errors import UserError


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="fedheads")
def main() -> None:
    """Train federated heads on cached features."""


if __name__ == "__main__":  # pragma: no cover
    main()
