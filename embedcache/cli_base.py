"""What both command lines (`embedcache`, `fedheads`) share."""

from __future__ import annotations

import sys

import click

from embedcache.errors import UserError


class UserErrorGroup(click.Group):
    """Turns a `UserError` anywhere below into one line on stderr (`error: ...`) and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
