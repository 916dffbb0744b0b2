"""`embedcache inspect | verify | import | export | gc | rm`: look after a feature store."""

from __future__ import annotations

import json
import sys

import click


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@click.command(name="inspect")
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect(store: str, as_json: bool) -> None:
    """List the shards of STORE: N, D, dtype, views, size on disk, complete, current or stale.

    A shard is current when its client is in the store's latest manifest and it was extracted
    under that manifest; stale shards are never trained on (`embedcache gc` removes them)."""
    from embedcache.store.maintenance import inspect_store

    rep = inspect_store(store)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
        return
    stale = f", {rep['stale_shards']} stale (`embedcache gc` removes them)" if rep["stale_shards"] else ""
    click.echo(f"{rep['store']}: {len(rep['classes'])} classes, {len(rep['shards'])} shards{stale}, "
               f"{_size(rep['bytes'])}, manifest {rep['manifest_hash'][:12]}")
    click.echo(f"{'shard':40s} {'N':>7s} {'D':>6s} {'dtype':8s} {'V':>2s} {'size':>10s} {'complete':8s} status")
    for s in rep["shards"]:
        click.echo(f"{s['shard']:40s} {s['n']:7d} {s['dim']:6d} {s['dtype']:8s} {s['views']:2d} "
                   f"{_size(s['bytes']):>10s} {'yes' if s['complete'] else 'NO':8s} "
                   f"{'current' if s['current'] else 'stale: ' + s['stale']}")


@click.command(name="verify")
@click.argument("store")
@click.option("--repair", is_flag=True,
              help="First rebuild the root metadata from the intact shards if it is lost (with --manifest: from that "
                   "manifest) and rewrite the consolidated metadata if it is missing or stale (data is never touched).")
@click.option("--manifest", "manifest_path", default=None,
              help="Also check the images against the manifest's fingerprints and every shard's samples against it.")
def verify(store: str, repair: bool, manifest_path: str | None) -> None:
    """Exit 0 only if every shard of STORE is complete and consistent (chunk sha256s re-checked)
    and its consolidated metadata matches the files (never trusted: the hierarchy is read);
    with --manifest, also that the images did not change since the manifest was written and
    that every shard holds the manifest's samples."""
    from embedcache.store.maintenance import repair_consolidated, repair_root, verify_against_manifest, verify_store

    manifest = None
    if manifest_path is not None:
        from embedcache.manifest import load_manifest

        manifest = load_manifest(manifest_path)

    if repair:
        rebuilt = repair_root(store, manifest)
        if rebuilt:
            click.echo(f"repaired: {rebuilt}", err=True)
        wrong = repair_consolidated(store)
        if wrong:
            click.echo(f"repaired: consolidated metadata {wrong}; rewritten from the files", err=True)
    problems = verify_store(store)
    if manifest is not None:
        problems += verify_against_manifest(store, manifest)
    for p in problems:
        click.echo(f"problem: {p}", err=True)
    if problems:
        sys.exit(1)
    click.echo(f"{store}: ok")


@click.command(name="import")
@click.argument("source")
@click.option("--store", required=True, help="Store directory (created if absent).")
@click.option("--backbone", default=None,
              help="Name the shards are stored under (required but for an export, where it picks one backbone).")
@click.option("--client", default=None, help="Client name ([A-Za-z0-9_.-]+); for a many-client SOURCE: only this one.")
@click.option("--split", type=click.Choice(["train", "test"]), default=None,
              help="Required for one file of arrays; for a many-client SOURCE: only this split.")
@click.option("--domain", default=None, help="Client domain (default: the export's, else the client name).")
@click.option("--features-key", default="features", show_default=True, help="Array name for features [N, D].")
@click.option("--labels-key", default="labels", show_default=True, help="Array name for labels [N].")
@click.option("--transpose", is_flag=True, help="Features are stored [D, N] (e.g. MATLAB column-major).")
@click.option("--classes", default=None, help="Comma-separated class names for a new store.")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default=None,
              help="Storage dtype (default: the file's: float16 stays float16, anything else float32).")
def import_(source: str, store: str, backbone: str | None, client: str | None, split: str | None,
            domain: str | None, features_key: str, labels_key: str, transpose: bool, classes: str | None,
            dtype: str | None) -> None:
    """Import SOURCE as complete shards, all or nothing: one file (.npz/.h5/.mat with `features`,
    `labels` [, `sample_ids`]; give --client and --split), what `embedcache export` wrote (.h5 file
    or npz directory: every shard, names, domains and classes kept), an HDF5 file with one group per
    client (<client>/<split>/features ...), or a directory of per-client files
    (<client>_<split>.npz or <client>/<split>.npz)."""
    from embedcache.store.importer import import_many

    specs = import_many(store, source, backbone=backbone, client=client, split=split, domain=domain,
                        features_key=features_key, labels_key=labels_key, transpose=transpose,
                        classes=classes.split(",") if classes else None, dtype=dtype)
    for spec in specs:
        click.echo(f"import: {spec.n} x {spec.feature_dim} -> {store}/{spec.backbone}/{spec.client}/{spec.split}",
                   err=True)


@click.command(name="export")
@click.option("--store", required=True)
@click.option("--format", "fmt", type=click.Choice(["h5", "npz"]), default="h5", show_default=True,
              help="h5: one HDF5 file, a group per shard; npz: a directory, one .npz per shard + export.json.")
@click.option("--out", required=True, help="Output file (h5) or directory (npz), written atomically.")
def export(store: str, fmt: str, out: str) -> None:
    """Export every shard of STORE (rows exactly as stored, checked); `embedcache import` reads it back."""
    from embedcache.store.export import export_store

    n = export_store(store, out, fmt)
    click.echo(f"export: {n} shards -> {out}", err=True)


def _removal_report(verb: str, paths: list[str], why: dict[str, str], dry_run: bool) -> None:
    for p in paths:
        click.echo(f"{verb}: {'would remove' if dry_run else 'removed'} {p}{f' ({why[p]})' if why.get(p) else ''}")


@click.command(name="gc")
@click.argument("store")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
def gc(store: str, dry_run: bool) -> None:
    """Remove the stale shards of STORE (clients the latest manifest dropped, shards extracted
    under an older manifest) and groups left empty; current shards are never touched."""
    from embedcache.store.maintenance import gc_plan, import_leftovers, remove

    plan = gc_plan(store)
    why = {s.path: f"stale: {s.stale}" for s in plan}
    if dry_run:
        paths = [s.path for s in plan] + import_leftovers(store)
    else:
        paths = remove(store, plan, only_stale=True)
    _removal_report("gc", paths, why, dry_run)
    if not paths:
        click.echo(f"gc: nothing stale in {store}")


@click.command(name="rm")
@click.argument("store")
@click.option("--backbone", required=True, help="Backbone name (or its group key, as `inspect` shows).")
@click.option("--client", default=None, help="Only this client's shards.")
@click.option("--split", type=click.Choice(["train", "test"]), default=None, help="Only this split.")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
def rm(store: str, backbone: str, client: str | None, split: str | None, dry_run: bool) -> None:
    """Remove shards of STORE (current or stale). The store's client list is kept, so a client
    left without a shard is reported as missing by `fedheads`, never silently left out."""
    from embedcache.store.maintenance import remove, rm_plan

    plan = rm_plan(store, backbone, client, split)
    paths = [s.path for s in plan] if dry_run else remove(store, plan)
    _removal_report("rm", paths, {}, dry_run)


COMMANDS = [inspect, verify, import_, export, gc, rm]
