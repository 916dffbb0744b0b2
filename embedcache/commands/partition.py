"""`embedcache partition SOURCE --scheme ... --out FILE`: write a data manifest."""

from __future__ import annotations

import click

LIST_CAP = 10  # per-client warning lines before "... and N more"


@click.command()
@click.argument("source")
@click.option("--scheme", type=click.Choice(["feature-shift", "label-shift", "feature-label-shift"]),
              default=None, help="Non-IID setting (FedPCL Tables 8-10). Required unless --preset.")
@click.option("--preset", type=click.Choice(["fedncm", "feddra"]), default=None,
              help="fedncm: label shift over all domains pooled, 100 clients, alpha 0.1, 80/20. feddra: label "
                   "shift over amazon+caltech10 pooled, 5 clients, alpha 1, 80/20, with texts (captioned:...).")
@click.option("--train-per-class", type=int, default=None,
              help="Feature(-label) shift: N per class [10] (feature shift: or --train-fraction).")
@click.option("--test-per-class", type=int, default=None,
              help="Feature(-label) shift: cap test images per class (default: the rest).")
@click.option("--clients", type=int, default=None,
              help="Label shift [5; with --client-sizes: the shape's own] / feature-label shift [one per domain]: "
                   "number of clients M.")
@click.option("--alpha", type=float, default=None, help="Label / feature-label shift: Dirichlet concentration [1.0].")
@click.option("--domain", "domain", default=None, help="One domain (label shift: the domain to draw clients from).")
@click.option("--domains", default=None, help="Comma-separated subset of domains.")
@click.option("--train-fraction", type=float, default=None,
              help="Label shift: training share per client [0.1]; feature shift: share per class and domain.")
@click.option("--min-samples", type=int, default=None,
              help="Label shift: fewest samples (before the train/test split) per client; re-draws below it [2].")
@click.option("--client-sizes", default=None, metavar="NAME|CSV",
              help="Label shift with a real federation's training sizes per client: inaturalist-users-120k "
                   "(9,275 clients, median 2), gldv2, or a CSV of sizes; --clients M draws M sizes at its "
                   "quantiles (default: its own, exactly); each client's class proportions ~ Dirichlet(alpha * C * "
                   "the pool's class frequencies); the rest of the pool is the test sets.")
@click.option("--fingerprint", type=click.Choice(["sha256", "stat"]), default="sha256", show_default=True,
              help="How images are fingerprinted so that extract never serves features of a changed image: "
                   "sha256 of the file's bytes (reads every file: a few percent of decoding it; the same on every "
                   "copy of the data set) or stat (size + mtime only: misses an image replaced by another of "
                   "the same size with its mtime kept, e.g. cp -p, rsync -t).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Manifest file (.json, .yaml or .yml).")
def partition(source, scheme, preset, train_per_class, test_per_class, clients, alpha, domain, domains,
              train_fraction, min_samples, client_sizes, fingerprint, seed, out) -> None:
    """Partition SOURCE (imagefolder:PATH | jda-digits:FILE.mat | builtin:digits | captioned:<one of
    these>) into clients. Sources with texts (captioned:, an image folder with captions.tsv) write
    each sample's text into the manifest."""
    from embedcache.api import partition as run_partition
    from embedcache.errors import UserError

    if domain and domains:
        raise UserError("--domain and --domains: give one of them (--domain D is --domains D)")
    manifest = run_partition(source, scheme, preset=preset, train_per_class=train_per_class,
                             test_per_class=test_per_class, clients=clients, alpha=alpha,
                             domains=domains or domain or (), train_fraction=train_fraction,
                             min_samples=min_samples, fingerprint=fingerprint, seed=seed, out=out,
                             client_sizes=client_sizes)
    _warn(manifest)
    n_tr = sum(len(c.train) for c in manifest.clients)
    n_te = sum(len(c.test) for c in manifest.clients)
    texts = ""
    if manifest.paired:
        distinct = len({s.text for s in manifest.all_samples()})
        texts = f", {distinct} distinct texts ({manifest.recipe.get('captions')})"
    click.echo(f"{out}: {len(manifest.clients)} clients, {len(manifest.classes)} classes, "
               f"{n_tr} train / {n_te} test samples{texts}, hash {manifest.content_hash[:12]}")


def _warn(manifest) -> None:
    """What the partitioner had to handle, on stderr; every item is also in manifest.report."""
    rep, recipe = manifest.report, manifest.recipe
    echo = lambda msg: click.echo(msg, err=True)  # noqa: E731
    for w in rep.get("warnings", []):
        echo(f"warning: {w if len(w) < 200 else w[:200] + ' ...'}")
    short = rep.get("short_classes", [])
    if short:
        echo(f"warning: {len(short)} class(es) have fewer images than asked for training (e.g. {short[0]}; "
             f"--train-per-class {recipe.get('train_per_class')}): all of them train, none is left to test; "
             f"listed in report.short_classes")
    missing, small = rep.get("missing_classes", {}), rep.get("small_clients", {})
    if missing:
        first = next(iter(missing))
        echo(f"note: {len(missing)} of {len(manifest.clients)} clients lack some class in training "
             f"(e.g. {first}: {', '.join(missing[first][:5])}); handled by the algorithms, listed in "
             f"the manifest's report.missing_classes")
    if small:
        echo(f"warning: {len(small)} client(s) have fewer than {recipe.get('min_samples')} training samples "
             f"(e.g. {next(iter(small))}); listed in report.small_clients")
    no_test = rep.get("clients_without_test", [])
    if no_test and len(no_test) == len(manifest.clients):
        echo(f"warning: NO client has a test sample, so no accuracy can be measured on this manifest "
             f"(lower --train-per-class or --train-fraction, or raise --test-per-class); all "
             f"{len(no_test)} are listed in report.clients_without_test")
        return
    for name in no_test[:LIST_CAP]:
        echo(f"warning: client {name} has 0 test samples: it will have no accuracy "
             f"(listed in report.clients_without_test)")
    if len(no_test) > LIST_CAP:
        echo(f"warning: ... and {len(no_test) - LIST_CAP} more clients with 0 test samples "
             f"(all {len(no_test)} in report.clients_without_test)")
