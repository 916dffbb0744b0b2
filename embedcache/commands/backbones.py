"""Placeholder: replaced by the owner of this command."""
import click


@click.command(name="backbones")
def backbones() -> None:
    """(not implemented yet)"""
    raise click.ClickException("backbones: not implemented yet")
