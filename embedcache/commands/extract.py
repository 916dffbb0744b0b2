"""`embedcache extract`: run frozen backbones over a manifest into the Zarr feature store."""

from __future__ import annotations

from pathlib import Path

import click

from embedcache.errors import UserError


@click.command(name="extract")
@click.option("--manifest", "manifest_path", required=True, help="Manifest file (.json/.yaml) from `embedcache partition`.")
@click.option("--backbones", required=True,
              help="Comma-separated backbone names, e.g. resnet20-cifar10,timm:resnet18; `default` is the "
                   "choice `embedcache backbones` prints. Text backbones (minilm-l6-v2; token states: "
                   "minilm-l6-v2:32@layer.5, stored with a mask) read each sample's text from the manifest.")
@click.option("--store", required=True, help="Store directory (created if absent).")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N")
@click.option("--batch-size", default=64, show_default=True, type=int, help="Rows per forward pass.")
@click.option("--num-workers", default=2, show_default=True, type=int, help="Decode+preprocess threads.")
@click.option("--scheduler", default=None, help="local:N (dask LocalCluster) or tcp://HOST:PORT; default: this process.")
@click.option("--views", default=1, show_default=True, type=int, help="V > 1 also stores V augmented views per image.")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="Storage dtype (float16 halves disk, loses precision; part of the cache key).")
@click.option("--cut", default=None, metavar="BLOCK",
              help="Store the activation map after BLOCK (flattened) instead of the pooled feature, for every "
                   "--backbones entry (same as naming B@BLOCK; `embedcache backbones` lists the cut points). "
                   "With --dtype float16 each value keeps 11 significant bits (relative error <= 4.9e-4).")
@click.option("--weights-dir", default=None, help="Where backbone weights are looked up first.")
@click.option("--chunk-rows", default=256, show_default=True, type=int, help="Rows per zarr chunk and per task.")
@click.option("--plugin", "plugins", multiple=True, help="Module to import first (e.g. registers custom backbones).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def extract(manifest_path: str, backbones: str, store: str, device: str, batch_size: int, num_workers: int,
            scheduler: str | None, views: int, dtype: str, weights_dir: str | None, chunk_rows: int,
            plugins: tuple[str, ...], quiet: bool, cut: str | None = None) -> None:
    """Extract features of every (backbone, client, split) of MANIFEST into STORE.

    Complete shards with the same cache key are reused without touching an image; an
    interrupted run resumes from its missing chunks.
    """
    if not Path(manifest_path).is_file():
        raise UserError(f"{manifest_path}: manifest file not found")
    if not plugins:  # a plugin's backbones are known once it is imported (by the run, after torch)
        from embedcache.backbone_names import check_backbone_name

        for b in backbones.split(","):
            if b.strip() and b.strip() != "default":
                check_backbone_name(b.strip())
    from embedcache.api import extract as run

    names = _expand_default(tuple(b.strip() for b in backbones.split(",") if b.strip()), weights_dir)
    rep = run(manifest_path, names, store, device=device, batch_size=batch_size, num_workers=num_workers,
              scheduler=scheduler, views=views, dtype=dtype, weights_dir=weights_dir, chunk_rows=chunk_rows,
              plugins=plugins, progress=not quiet, cut=cut)
    click.echo(f"extract: {rep.shards} shards ({rep.cache_hits} cache hits), {rep.chunks_computed} chunks, "
               f"{rep.rows_computed} rows in {rep.seconds:.1f}s -> {store}", err=True)


def _expand_default(names: tuple[str, ...], weights_dir: str | None) -> tuple[str, ...]:
    """`default` -> the backbones `embedcache backbones` calls default here (said once on stderr)."""
    from embedcache.api import expand_default

    out, said = expand_default(names, weights_dir)
    if said:
        click.echo(f"backbones: {said}", err=True)
    return out
