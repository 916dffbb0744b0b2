"""``embedcache backbones``: which backbones exist, their dimension, and whether their
weights are available here (never builds a model, never downloads)."""

from __future__ import annotations

import json
from dataclasses import asdict

import click


@click.command(name="backbones")
@click.option("--weights-dir", type=click.Path(file_okay=False), default=None,
              help="Weights directory (default: $EMBEDCACHE_WEIGHTS > $EMBEDCACHE_ASSETS/weights > "
                   "../shared/weights > ~/.cache/embedcache/weights).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def backbones(weights_dir: str | None, as_json: bool) -> None:
    """List registered backbones: name, dim, modality, source, available, cut points, reason."""
    from embedcache.backbones import default_backbones_with_reason, list_backbones, resolve_weights_dir

    rows = list_backbones(weights_dir)
    default, why = default_backbones_with_reason(weights_dir)
    if as_json:
        click.echo(json.dumps({"weights_dir": str(resolve_weights_dir(weights_dir)), "default": default,
                               "default_reason": why, "backbones": [asdict(r) for r in rows]}, indent=2))
        return
    table = [("name", "dim", "modality", "source", "available", "cut points (B@CUT, --cut)", "reason")]
    for r in rows:
        table.append((r.name, "" if r.feature_dim is None else str(r.feature_dim), r.modality, r.source,
                      "yes" if r.available else "no", _cuts(r), _short(r.reason)))
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    click.echo(f"weights dir: {resolve_weights_dir(weights_dir)}")
    for row in table:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row[:6], widths)) + "  " + row[6])
    click.echo(f"default: {', '.join(default)} ({why})")


def _cuts(row) -> str:
    if row.trainable is None:
        return "depends on the model"
    if not row.trainable:
        return "not trainable"
    cuts = list(row.cut_points)
    if len(",".join(cuts)) <= 40:
        return ",".join(cuts)
    return f"{cuts[0]},{cuts[1]},...,{cuts[-1]} ({len(cuts)}; --json lists all)"


def _short(text: str) -> str:
    """A reason with its paths shortened (the full ones are in --json): site-packages, the home
    directory and the working directory abbreviated."""
    import os
    import re
    import sys

    text = re.sub(r"\S*/(site|dist)-packages/", "<site-packages>/", text)
    for root, mark in ((os.getcwd(), "."), (os.path.expanduser("~"), "~"), (sys.prefix, "<venv>")):
        if root and root != "/":
            text = text.replace(root + os.sep, mark + os.sep)
    return text
