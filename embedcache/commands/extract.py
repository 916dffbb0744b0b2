"""Placeholder: replaced by the owner of this command."""
import click


@click.command(name="extract")
def extract() -> None:
    """(not implemented yet)"""
    raise click.ClickException("extract: not implemented yet")
