"""Placeholder: replaced by the owner of this command."""
import click


@click.command(name="partition")
def partition() -> None:
    """(not implemented yet)"""
    raise click.ClickException("partition: not implemented yet")
