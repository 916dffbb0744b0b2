"""`python -m pipelines`: every table and figure of the papers as one command.

    python -m pipelines list [--json]
    python -m pipelines run NAME... [--scale smoke|ci|paper] [--scheduler serial|local:N|tcp://HOST:PORT]
                            [--out DIR] [--cache DIR] [--source KEY=SPEC]... [--originals] [--force] [--dry-run]
    python -m pipelines report DIR [NAME...]

Bad input prints one `error: ...` line and exits 2; a run whose cells failed exits 1 (the
report says which and why), and so does an experiment none of whose arms can run in this build
(one `error: NAME: <why>` line, e.g. "fedheads feddra not available in this build"; its report
still shows the published values)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from embedcache.cli_base import UserErrorGroup
from embedcache.errors import UserError
from pipelines import datasets, plan, registry, report
from pipelines.spec import SCALES


@click.group(cls=UserErrorGroup)
def main() -> None:
    """Reproduce the FedPCL, FedNCM and FedDRA experiments on cached features and write reports
    that put the published numbers beside ours."""


def _sizes(exp, ctx_base: plan.RunContext) -> dict[str, dict[str, int]]:
    out = {}
    for scale in SCALES:
        arms = plan.arms(exp, plan.RunContext(**{**ctx_base.__dict__, "scale": scale}))
        run = [a for a in arms if not a.unavailable]
        out[scale] = {"cells": sum(len(a.seeds) for a in run), "arms": len(run),
                      "unavailable": len(arms) - len(run),
                      "rounds_x_cells": sum(len(a.seeds) * a.rounds for a in run)}
    return out


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--source", "sources", multiple=True, metavar="KEY=SPEC", help="As for `run`.")
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE", help="As for `run`.")
def list_cmd(as_json: bool, sources: tuple[str, ...], plugins: tuple[str, ...]) -> None:
    """The registry: each experiment with its cells at each scale and what cannot run here."""
    _import_plugins(plugins)
    ctx = plan.RunContext(sources=tuple(datasets.parse_sources(sources).items()))
    rows = []
    for exp in registry.experiments():
        rows.append({"name": exp.name, "paper": exp.paper, "source": exp.source, "title": exp.title,
                     "points": len(exp.points), "methods": len(exp.methods), "published": len(exp.published),
                     "scales": _sizes(exp, ctx)})
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(f"{'experiment':20} {'source':22} {'smoke':>6} {'ci':>6} {'paper':>6}  n/a  title")
    for r in rows:
        s = r["scales"]
        na = s["paper"]["unavailable"]
        click.echo(f"{r['name']:20} {r['paper'] + ' ' + r['source']:22} {s['smoke']['cells']:>6} {s['ci']['cells']:>6} "
                   f"{s['paper']['cells']:>6}  {na:>3}  {r['title']}")
    click.echo("(cells = point x method x seed that can run here; n/a = arms that cannot, at paper scale: "
               "`run --dry-run` says why)")


@main.command()
@click.argument("names", nargs=-1, required=True)
@click.option("--scale", type=click.Choice(SCALES), default="ci", show_default=True,
              help="paper: the paper's protocol; ci: minutes on 2 cores; smoke: seconds.")
@click.option("--scheduler", default=None, help="serial | local:N | tcp://HOST:PORT  [default: local:<CPUs>]")
@click.option("--out", default="runs/pipelines", show_default=True, type=click.Path(file_okay=False),
              help="Reports in OUT/<name>/, cells in OUT/cells/, OUT/index.md.")
@click.option("--cache", default=None, type=click.Path(file_okay=False),
              help="Manifests, feature pools and stores  [default: OUT/cache].")
@click.option("--source", "sources", multiple=True, metavar="KEY=SPEC",
              help="A real copy of a data set, e.g. digit5=imagefolder:/data/digit5 (data_manifests/README.md).")
@click.option("--originals", is_flag=True, help="The papers' backbones instead of the offline stand-ins.")
@click.option("--backbone", "backbone_map", multiple=True, metavar="NAME=OTHER",
              help="Use backbone OTHER wherever an experiment names NAME (e.g. your own checkpoint).")
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE",
              help="Import MODULE first (it may register experiments or backbones).")
@click.option("--device", default="cpu", show_default=True, help="Where cells train (cpu | cuda | cuda:N).")
@click.option("--threads", default=1, show_default=True, help="Torch threads per cell (cells run in parallel).")
@click.option("--weights-dir", default=None, help="As for `embedcache extract`.")
@click.option("--force", is_flag=True, help="Re-run cells that are already complete.")
@click.option("--dry-run", is_flag=True, help="Say what would run (and what cannot, and why); run nothing.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def run(names, scale, scheduler, out, cache, sources, originals, backbone_map, plugins, device, threads, weights_dir,
        force, dry_run, quiet) -> None:
    """Run experiments NAME... (names, globs such as 'fedpcl-*', or 'all')."""
    from pipelines import driver, sweep

    _import_plugins(plugins)
    exps = registry.select(names)
    if threads < 1:
        raise UserError(f"--threads {threads}: must be >= 1")
    sched = sweep.parse_scheduler(scheduler)
    ctx = plan.RunContext(scale=scale, sources=tuple(datasets.parse_sources(sources).items()), originals=originals,
                          device=device, threads=threads, weights_dir=weights_dir,
                          backbone_map=_pairs(backbone_map, "--backbone"))
    plan.check_backbone_map(exps, ctx.backbone_map, weights_dir)
    outp = Path(out)
    if dry_run:
        for exp in exps:
            _dry_run(exp, ctx)
        return
    summary = driver.run_experiments(exps, ctx, outp, scheduler=sched, cache=Path(cache) if cache else None,
                                     force=force, progress=not quiet)
    failed = 0
    for name, s in summary.items():
        failed += s["failed"]
        if s["arms"] and s["unavailable"] == s["arms"]:  # nothing could run: say why in one line, exit 1
            click.echo(f"error: {name}: {s['why']}", err=True)
            failed += 1
            continue
        click.secho(f"{name}: {s['done']} cells done, {s['failed']} failed, {s['unavailable']} arms not available; "
                    f"report: {outp / name / 'report.md'}", fg="red" if s["failed"] else "green", err=True)
    click.secho(f"index: {outp / 'index.md'}", err=True)
    if failed:
        sys.exit(1)


def _import_plugins(plugins: tuple[str, ...]) -> None:
    from embedcache.plugins import import_plugins

    import_plugins(plugins)


def _pairs(items: tuple[str, ...], flag: str) -> tuple[tuple[str, str], ...]:
    out = []
    for it in items:
        a, eq, b = it.partition("=")
        if not eq or not a.strip() or not b.strip():
            raise UserError(f"{flag} {it!r}: expected NAME=OTHER")
        out.append((a.strip(), b.strip()))
    return tuple(out)


def _dry_run(exp, ctx: plan.RunContext) -> None:
    arms = plan.arms(exp, ctx)
    run_ = [a for a in arms if not a.unavailable]
    click.echo(f"{exp.name} ({exp.paper} {exp.source}) at {ctx.scale} scale: "
               f"{sum(len(a.seeds) for a in run_)} cells in {len(run_)} arms, "
               f"{sum(len(a.seeds) * a.rounds for a in run_)} cell-rounds")
    for a in arms:
        what = a.unavailable or (f"{len(a.seeds)} seeds x {a.rounds} rounds on {', '.join(a.backbones)}; "
                                 f"data {dict(a.data.recipe) if a.data else '-'}")
        click.echo(f"  {a.label}: {what}")


@main.command("report")
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("names", nargs=-1)
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE", help="As for `run`.")
def report_cmd(out: str, names: tuple[str, ...], plugins: tuple[str, ...]) -> None:
    """Rebuild the reports in OUT (every experiment with a plan.json, or NAME...) and the index."""
    _import_plugins(plugins)
    outp = Path(out)
    if not outp.is_dir():
        raise UserError(f"{out}: no such directory")
    exps = registry.select(names) if names else [e for e in registry.experiments() if (outp / e.name / "plan.json").is_file()]
    if not exps:
        raise UserError(f"{out}: holds no experiment run (no <name>/plan.json)")
    for exp in exps:
        s = report.write_experiment(exp, outp / exp.name, outp / "cells")
        click.echo(f"{exp.name}: {s['done']} done, {s['failed']} failed, {s['pending']} pending -> "
                   f"{outp / exp.name / 'report.md'}", err=True)
    report.write_index(outp)
    click.echo(f"index: {outp / 'index.md'}", err=True)
