"""`fedheads` command line: train / compare / predict / finetune / feddra / algorithms / summarize, and
over Flower simulate / serve / join (fedheads.flower, imported only by those three).

Each command's options are generated from its declared options object (fedheads.run.commands) by
fedheads.run.options: the flags and their --help, --config / --dump-config, and the checks of their
values. Every command reads the feature
store through `embedcache.store.reader` (numpy + zarr) and never imports timm, torchvision or
dask. Bad input prints one `error: ...` line and exits 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from embedcache.cli_base import UserErrorGroup
from embedcache.errors import UserError
from fedheads.privacy_accounting import privacy_lines
from fedheads.run.checks import store_with
from fedheads.run.commands import Compare, FedDRA, Finetune, Join, Predict, Serve, Simulate, Train
from fedheads.run.options import (
    DeclaredCommand,
    command_options,
    config_options,
    dump,
    file_config,
    from_context,
    retired_lines,
)
from fedheads.version import __version__


@click.group(cls=UserErrorGroup)
@click.version_option(__version__, prog_name="fedheads")
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE",
              help="Import MODULE first, e.g. one that registers your own algorithm (repeatable; "
                   "also $FEDHEADS_PLUGINS, comma-separated).")
def main(plugins: tuple[str, ...]) -> None:
    """Train federated heads (FedPCL, FedNCM, LP, MLP, baselines) on cached features."""
    import os

    from embedcache.plugins import FEDHEADS_ENV, import_plugins, plugin_names
    from fedheads.run.allocator import one_arena

    one_arena()  # before a store is read: what helper threads free is reused (fedheads/run/allocator.py)
    import_plugins(plugin_names(plugins, os.environ.get(FEDHEADS_ENV)))


_MERGE = ("\n\nOptions also come from --config FILE (YAML or JSON; merge order: built-in defaults < config file < "
          "command-line flags, incl. --set); --dump-config prints the effective configuration.")
def _command(cls: type, *, config: bool = True, extra: tuple[Callable, ...] = (),
             **kw: Any) -> Callable[[Callable], Callable]:
    """A `fedheads` command whose options are `cls`'s (and --config/--dump-config unless `config`
    is False); the options it retired (`cls.retired`) are refused naming their replacement."""
    def deco(f: Callable) -> Callable:
        f = click.pass_context(f)
        for e in extra:
            f = e(f)
        f = config_options(f) if config else f
        return main.command(cls=DeclaredCommand, declared=cls, retired=lambda: retired_lines(cls, "--set "), **kw)(
            command_options(cls)(f))

    return deco


@_command(Train, help=f"Train one algorithm over several seeds; write RUN_DIR/results.json and friends.{_MERGE}")
def train(ctx: click.Context, dump_config: bool, **_: Any) -> None:
    from fedheads.run.checks import check_algorithms

    cmd = from_context(Train, ctx)
    check_algorithms([cmd.algorithm])
    info = store_with(cmd.store, cmd.backbones, required=not dump_config)
    from fedheads.run.allocator import GlibcHeap
    from fedheads.run.train import run_config, train_run

    if dump_config:
        click.echo(dump("train", run_config(cmd)), nl=False)
        return
    # the store opened once for the whole run; this process's heap run the command's way (fedheads/run/allocator.py)
    res = train_run(cmd.store if info is None else info, list(cmd.backbones), cmd.algorithm, cmd.options, cmd.out,
                    overwrite=cmd.overwrite, resume=cmd.resume, heap=GlibcHeap())
    click.echo(f"{cmd.algorithm}: accuracy {res['accuracy_cell']} over seeds {res['seeds']} -> {cmd.out}/results.json")
    for line in privacy_lines(res.get("privacy")):
        click.echo(line, err=True)


@_command(Compare, help=f"Train several algorithms on the same features; write a paper-style table and plots.{_MERGE}")
def compare(ctx: click.Context, dump_config: bool, **_: Any) -> None:
    from fedheads.run.checks import check_algorithms

    cmd = from_context(Compare, ctx)
    check_algorithms(cmd.algorithms)
    info = store_with(cmd.store, cmd.backbones, required=not dump_config)
    from fedheads.report import results as report
    from fedheads.run.allocator import GlibcHeap
    from fedheads.run.train import check_compare_settings, compare_runs, run_config

    if dump_config:
        check_compare_settings(cmd.algorithms, cmd.options)
        click.echo(dump("compare", run_config(cmd)), nl=False)
        return
    res = compare_runs(cmd.store if info is None else info, list(cmd.backbones), cmd.algorithms, cmd.options, cmd.out,
                       overwrite=cmd.overwrite, resume=cmd.resume, heap=GlibcHeap())
    click.echo(report.comparison_markdown(list(res["algorithms"].values())))
    click.echo(f"report: {Path(cmd.out) / 'summary.md'}", err=True)


@_command(Predict, config=False)
def predict(ctx: click.Context, **_: Any) -> None:
    """Classify samples with a trained run: stored features, a manifest, or new images (extracted
    with the run's backbones, checked against training's), by nearest prototype (faiss) or head."""
    from fedheads.prediction.predict import run_predict

    p = from_context(Predict, ctx)
    res = run_predict(p)
    for line in res.accuracy_lines():
        click.echo(line)
    click.echo(f"{res.rows} predictions -> {p.out}")


def _list_settings(module: str) -> Callable[[Callable], Callable]:
    """An eager --list-settings flag: the command's settings (key, type, default, doc [source],
    read from the config fields' metadata), then exit."""

    def show(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if not value or ctx.resilient_parsing:
            return
        import importlib

        from fedheads.run.settings import command_settings, rows_table

        click.echo("\n".join(rows_table(command_settings(importlib.import_module(module).SETTINGS))))
        ctx.exit()

    return click.option("--list-settings", is_flag=True, is_eager=True, expose_value=False, callback=show,
                        help="Every --set key with its type, default, doc and paper source, and exit.")


@_command(Finetune, extra=(_list_settings("fedheads.finetuning.runner"),))
def finetune(ctx: click.Context, dump_config: bool, **_: Any) -> None:
    """Fine-tune a backbone federatedly from a stage-1 head computed on the store (FedNCM+FT, Fed3R+FT,
    FedCOF+FT, LP+FT, FT).

    Method settings (the server and client optimisers, stage-1 LP rounds, which blocks train, BatchNorm,
    augmentation) are --set KEY=VALUE. Options also come from --config FILE (YAML or JSON; defaults < file <
    command-line flags); --dump-config prints the effective configuration, every setting included."""
    cmd = from_context(Finetune, ctx)
    if not dump_config:  # a dump is written as given, checked when it is run
        from embedcache.backbone_names import check_backbone_name
        from fedheads.run.checks import check_finetune_heads

        check_finetune_heads(cmd.run.heads)
        check_backbone_name(cmd.backbone)
    from fedheads.finetuning.runner import finetune_options, finetune_run, finetune_settings

    opts = finetune_options(cmd.run)
    if dump_config:
        click.echo(dump("finetune", {**file_config(cmd), "set": finetune_settings(opts)}), nl=False)
        return
    res = finetune_run(cmd.manifest, str(cmd.store), cmd.backbone, cmd.out, opts)
    for r in res.get("algorithms", {"": res}).values():
        click.echo(f"{r['algorithm']}: accuracy {r['accuracy_cell']} after {r['rounds']} rounds "
                   f"(round 0: {r['figure1'][0]['accuracy']:.2f})")
    click.echo(f"report: {Path(cmd.out) / 'summary.md'}", err=True)


@_command(FedDRA, extra=(_list_settings("fedheads.alignment.runner"),))
def feddra(ctx: click.Context, dump_config: bool, **_: Any) -> None:
    """FedDRA (federated distributionally robust vision-language alignment) and its baselines.

    Method settings (DRO radius and divergence, the constraint weight mu, local steps, learning rates, the
    schedule, which encoder blocks train) are --set KEY=VALUE. Options also come from --config FILE (YAML or
    JSON; defaults < preset < file < command-line flags); --dump-config prints the effective configuration,
    every setting included (the preset's values resolved)."""
    cmd = from_context(FedDRA, ctx)
    if not dump_config:  # a dump is written as given, checked when it is run
        from embedcache.backbone_names import check_backbone_name
        from fedheads.run.checks import FEDDRA_BASELINES, check_choices

        check_choices(cmd.run.baselines, FEDDRA_BASELINES, "baseline", "--baseline")
        for name in (cmd.image_encoder, cmd.text_encoder):
            check_backbone_name(name)
    from fedheads.alignment.runner import feddra_options, feddra_run, feddra_settings, summary_line

    opts = feddra_options(cmd.run)
    if dump_config:  # the preset's values resolved, so the file means the same under any preset
        click.echo(dump("feddra", {**file_config(cmd), "rounds": opts.rounds, "set": feddra_settings(opts)}), nl=False)
        return
    res = feddra_run(cmd.manifest, cmd.store, cmd.image_encoder, cmd.text_encoder, cmd.out, opts)
    for r in res.get("algorithms", {"": res}).values():
        click.echo(summary_line(r))
    click.echo(f"report: {Path(cmd.out) / 'summary.md'}", err=True)


def _given(ctx: click.Context) -> Callable[[str], bool]:
    return lambda k: ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT


@_command(Simulate, config=False)
def simulate(ctx: click.Context, **_: Any) -> None:
    """Run an algorithm over Flower's simulation runtime in this process (same results as `train`)."""
    from fedheads.flower import commands as fl

    click.echo(fl.simulate(fl.checked(from_context(Simulate, ctx), _given(ctx)), lambda m: click.echo(m, err=True)))


@_command(Serve, config=False)
def serve(ctx: click.Context, **_: Any) -> None:
    """Start a Flower SuperLink, run an algorithm over the nodes that join, write --out (with
    --dp-*: under differential privacy, docs/flower.md)."""
    from fedheads.flower import commands as fl

    click.echo(fl.serve(fl.checked(from_context(Serve, ctx), _given(ctx)), lambda m: click.echo(m, err=True)))


@_command(Join, config=False)
def join(ctx: click.Context, **_: Any) -> None:
    """Run a Flower SuperNode for this node's own data until the SuperLink goes away."""
    from fedheads.flower import commands as fl

    fl.join(from_context(Join, ctx), lambda m: click.echo(m, err=True))


@main.command(name="algorithms")
@click.argument("name", required=False)
@click.option("--show", is_flag=True, help="Every algorithm's settings (with NAME: that one's; NAME alone does too).")
@click.option("--json", "as_json", is_flag=True)
def algorithms_cmd(name: str | None, show: bool, as_json: bool) -> None:
    """List the registered algorithms; with NAME (or --show), every setting --set takes:
    type, default, one-line doc and the paper passage the default comes from. The settings text
    needs torch the first time; it is then kept in $FEDHEADS_CACHE (default ~/.cache/fedheads),
    keyed by the sha256 of the package's sources."""
    from fedheads.run.settings import describe

    click.echo(describe(name, show, as_json))
    if name is None and not show and not as_json:
        click.echo("settings of one: fedheads algorithms NAME", err=True)


@main.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path())
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="table.md or table.csv (default: Markdown on stdout).")
def summarize(runs: tuple[str, ...], out: str | None) -> None:
    """One table across RUN_DIRs (train, compare, finetune): accuracy, fairness, upload, time."""
    from fedheads.report.summarize import summarize as gather
    from fedheads.report.summarize import to_markdown, write_table

    if out is not None and not out.lower().endswith((".md", ".csv")):
        raise UserError(f"--out {out}: must end in .md or .csv")
    rows = gather(runs)
    if out is None:
        click.echo(to_markdown(rows), nl=False)
        return
    write_table(rows, out)
    click.echo(f"{len(rows)} rows -> {out}", err=True)


if __name__ == "__main__":  # pragma: no cover
    main()
