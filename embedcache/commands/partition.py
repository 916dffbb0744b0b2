"""`embedcache partition SOURCE --scheme ... --out FILE`: write a data manifest."""

from __future__ import annotations

import click


@click.command()
@click.argument("source")
@click.option("--scheme", type=click.Choice(["feature-shift", "label-shift", "feature-label-shift"]),
              default=None, help="Non-IID setting (FedPCL Tables 8-10). Required unless --preset.")
@click.option("--preset", type=click.Choice(["fedncm"]), default=None,
              help="fedncm: label shift over all domains pooled, 100 clients, alpha 0.1.")
@click.option("--train-per-class", type=int, default=None, help="Feature(-label) shift: N per class [10].")
@click.option("--test-per-class", type=int, default=None, help="Cap test images per class (default: the rest).")
@click.option("--clients", type=int, default=None, help="Label / feature-label shift: number of clients M.")
@click.option("--alpha", type=float, default=None, help="Dirichlet concentration [1.0].")
@click.option("--domain", "domain", default=None, help="Label shift: the one domain to draw clients from.")
@click.option("--domains", default=None, help="Comma-separated subset of domains.")
@click.option("--train-fraction", type=float, default=None, help="Label shift: training share per client [0.1].")
@click.option("--min-samples", type=int, default=None, help="Label shift: fewest samples (before the train/test split) per client; re-draws below it [2].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Manifest file (.json).")
def partition(source, scheme, preset, train_per_class, test_per_class, clients, alpha, domain, domains,
              train_fraction, min_samples, seed, out) -> None:
    """Partition SOURCE (imagefolder:PATH | jda-digits:FILE.mat | builtin:digits) into clients."""
    from embedcache.errors import UserError
    from embedcache.manifest import save_manifest
    from embedcache.partition import PRESETS, Recipe
    from embedcache.partition import partition as run_partition
    from embedcache.sources import open_source

    base: dict = dict(PRESETS[preset]) if preset else {}
    if scheme is None and "scheme" not in base:
        raise UserError("--scheme: required (or --preset fedncm)")
    given = {"scheme": scheme, "train_per_class": train_per_class, "test_per_class": test_per_class,
             "clients": clients, "alpha": alpha, "train_fraction": train_fraction, "min_samples": min_samples}
    base.update({k: v for k, v in given.items() if v is not None})
    doms = tuple(d.strip() for d in domains.split(",") if d.strip()) if domains else ()
    if domain:
        doms = (domain,)
    recipe = Recipe(domains=doms, **base)
    manifest = run_partition(open_source(source), recipe, seed)
    save_manifest(manifest, out)
    rep = manifest.report
    for w in rep.get("warnings", []):
        click.echo(f"warning: {w if len(w) < 200 else w[:200] + ' ...'}", err=True)
    missing, small = rep.get("missing_classes", {}), rep.get("small_clients", {})
    if missing:
        first = next(iter(missing))
        click.echo(f"note: {len(missing)} of {len(manifest.clients)} clients lack some class in training "
                   f"(e.g. {first}: {', '.join(missing[first][:5])}); handled by the algorithms, listed in "
                   f"the manifest's report.missing_classes", err=True)
    if small:
        click.echo(f"warning: {len(small)} client(s) have fewer than {recipe.min_samples} training samples "
                   f"(e.g. {next(iter(small))}); listed in report.small_clients", err=True)
    n_tr = sum(len(c.train) for c in manifest.clients)
    n_te = sum(len(c.test) for c in manifest.clients)
    click.echo(f"{out}: {len(manifest.clients)} clients, {len(manifest.classes)} classes, "
               f"{n_tr} train / {n_te} test samples, hash {manifest.content_hash[:12]}")
