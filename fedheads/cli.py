"""`fedheads` command line: train / compare / predict / finetune / feddra / algorithms / summarize, and
over Flower simulate / serve / join (fedheads.flower, imported only by those three).

Each command's options are generated from its declared options object (fedheads.run.commands;
fedheads.flower.run_config for the Flower commands) by fedheads.run.options: the flags and their
--help, --config / --dump-config, and the checks of their values. Every command reads the feature
store through `embedcache.store.reader` (numpy + zarr) and never imports timm, torchvision or
dask. Bad input prints one `error: ...` line and exits 2."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from embedcache.cli_base import UserErrorGroup
from embedcache.errors import UserError
from fedheads.flower.run_config import Join, Serve, Simulate
from fedheads.run.commands import Compare, FedDRA, Finetune, Predict, Train
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
        return main.command(cls=DeclaredCommand, retired=lambda: retired_lines(cls, "--set "), **kw)(
            command_options(cls)(f))

    return deco


def _store_info(store: str | None, backbones: Any) -> Any:
    """The store opened to check that it has the backbones (the run reads it, not opened again);
    None where it does not exist (the run says so; --dump-config needs none)."""
    if store is None or not Path(store).exists():
        return None
    from embedcache.errors import did_you_mean
    from embedcache.store.reader import open_store

    info = open_store(store)
    for b in backbones:
        if b not in info.backbones:
            raise UserError(f"backbone {b!r}: not in store {info.path}{did_you_mean(b, info.backbones)} "
                            f"(has: {', '.join(info.backbones)})")
    return info


@_command(Train, help=f"Train one algorithm over several seeds; write RUN_DIR/results.json and friends.{_MERGE}")
def train(ctx: click.Context, dump_config: bool, **_: Any) -> None:
    from fedheads.run.checks import check_algorithms

    cmd = from_context(Train, ctx)
    check_algorithms([cmd.algorithm])
    info = _store_info(cmd.store, cmd.backbones)
    from fedheads.run.allocator import GlibcHeap
    from fedheads.run.train import run_config, train_run

    if dump_config:
        click.echo(dump("train", run_config(cmd)), nl=False)
        return
    # the store opened once for the whole run; this process's heap run the command's way (fedheads/run/allocator.py)
    res = train_run(cmd.store if info is None else info, list(cmd.backbones), cmd.algorithm, cmd.options, cmd.out,
                    overwrite=cmd.overwrite, resume=cmd.resume, heap=GlibcHeap())
    click.echo(f"{cmd.algorithm}: accuracy {res['accuracy_cell']} over seeds {res['seeds']} -> {cmd.out}/results.json")


@_command(Compare, help=f"Train several algorithms on the same features; write a paper-style table and plots.{_MERGE}")
def compare(ctx: click.Context, dump_config: bool, **_: Any) -> None:
    from fedheads.run.checks import check_algorithms

    cmd = from_context(Compare, ctx)
    check_algorithms(cmd.algorithms)
    info = _store_info(cmd.store, cmd.backbones)
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


def _flower(ctx: click.Context, cls: type) -> Any:
    """The Flower command's options: the algorithm name checked, its run directory absolute, the
    extra present, and an algorithm without a DP form refused before any server starts."""
    from fedheads.run.checks import check_algorithms

    cmd = from_context(cls, ctx)
    check_algorithms([cmd.run.algorithm])
    for k in ("dp_epsilon", "dp_noise_multiplier"):  # 0 means "not given" in a run config: one given must be > 0
        if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT and not ctx.params[k] > 0:
            raise UserError(f"--{k.replace('_', '-')} {ctx.params[k]}: must be a positive number")
    import dataclasses

    from fedheads.flower import require_flower

    require_flower()  # one line without the extra, before anything is written
    cmd = dataclasses.replace(cmd, run=dataclasses.replace(cmd.run, out=str(Path(cmd.run.out).resolve())))
    if cmd.run.mechanism() is not None:
        from fedheads.flower.loop import build

        build(cmd.run)  # the server's algorithm under the mechanism: refuses one without a DP form
    return cmd


def _flower_summary(res: dict, out: str) -> None:
    """One line; the node count is that of the accuracy mean (nodes evaluated), dropped ones named."""
    fl = res.get("flower", {})
    over = sum(1 for v in res.get("per_client", {}).values() if v.get("mean") is not None)
    dropped = res.get("clients_dropped") or []
    click.echo(f"{res['algorithm']} over Flower ({res['engine']}): accuracy {res['accuracy_cell']} over {over} of "
               f"{len(fl.get('nodes', {}))} nodes" + (f" ({', '.join(dropped)} dropped)" if dropped else "")
               + f", {fl.get('sent_bytes', 0) + fl.get('received_bytes', 0):,} bytes -> {out}/results.json")


@_command(Simulate, config=False)
def simulate(ctx: click.Context, **_: Any) -> None:
    """Run an algorithm over Flower's simulation runtime in this process (same results as `train`)."""
    cmd = _flower(ctx, Simulate)
    from fedheads.flower.sim import flower_logs, simulate_store
    from fedheads.run import rundir

    out = Path(cmd.run.out)
    with rundir.locked(out):  # one run writes --out at a time, as for `train`
        rundir.refuse_existing(out, overwrite=cmd.run.overwrite)  # before flower.log: a run there is left untouched
        with flower_logs(out / "flower.log", lambda m: click.echo(m, err=True)):
            simulate_store(cmd.run, cmd.store, [c for c in cmd.run.clients.split(",") if c] or None,
                           noise_seed=cmd.dp_noise_seed)
    _flower_summary(json.loads((out / "results.json").read_text()), cmd.run.out)


@_command(Serve, config=False)
def serve(ctx: click.Context, **_: Any) -> None:
    """Start a Flower SuperLink, run an algorithm over the nodes that join, write --out (with
    --dp-*: under differential privacy, docs/flower.md)."""
    cmd = _flower(ctx, Serve)
    cfg = cmd.run
    if cfg.dp_mode == "distributed" and not cfg.secagg and cfg.mechanism() is not None:
        click.echo("note: --dp-mode distributed without --secagg: the server sees each node's sums with only "
                   "its share of the noise (docs/flower.md)", err=True)
    tls = {"certfile": cmd.ssl_certfile, "keyfile": cmd.ssl_keyfile, "ca": cmd.ssl_ca_certfile}
    if any(tls.values()) and not all(tls.values()):
        raise UserError("--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile: give all three (or none: insecure)")
    from fedheads.flower.deploy import serve as run_serve
    from fedheads.run import rundir

    with rundir.locked(Path(cfg.out)):  # one run writes --out at a time, as for `train`
        res = run_serve(cfg.to_run_config(), Path(cfg.out), host=cmd.host, port=cmd.port,
                        tls=tls if all(tls.values()) else None, timeout=cfg.wait + cfg.timeout * (cfg.rounds + 2),
                        echo=lambda m: click.echo(m, err=True))
    _flower_summary(res, cfg.out)


@_command(Join, config=False)
def join(ctx: click.Context, **_: Any) -> None:
    """Run a Flower SuperNode for this node's own data until the SuperLink goes away."""
    import os

    from fedheads.flower.deploy import join_command

    j = from_context(Join, ctx)
    store = Path(j.store).resolve()
    node = {"store": str(store), "client": j.client, "device": j.device,
            "manifest": str(Path(j.manifest).resolve()) if j.manifest else "", "weights-dir": j.weights_dir}
    cmd, env = join_command(j.superlink, node, store.parent / f".{store.name}.flower", j.port,
                            insecure=j.root_certificates is None, root_certificates=j.root_certificates)
    store.parent.mkdir(parents=True, exist_ok=True)
    log = None if j.log == "-" else Path(j.log or store.with_name(store.name + ".flower.log"))
    click.echo(f"joining {j.superlink} as {j.client or store.name} (SuperNode, this PID"
               + (f"; its log: {log})" if log else ")"), err=True)
    if log is not None:  # the SuperNode's connection retries and per-message lines go to its log
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise UserError(f"--log {log}: cannot write it ({exc.strerror or exc}); give another --log") from None
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    os.execve(cmd[0], cmd, env)  # the SuperNode takes this process over: signals reach it directly


@main.command(name="algorithms")
@click.argument("name", required=False)
@click.option("--show", is_flag=True, help="Every algorithm's settings (with NAME: that one's; NAME alone does too).")
@click.option("--json", "as_json", is_flag=True)
def algorithms_cmd(name: str | None, show: bool, as_json: bool) -> None:
    """List the registered algorithms; with NAME (or --show), every setting --set takes:
    type, default, one-line doc and the paper passage the default comes from."""
    from fedheads.run.checks import check_algorithms

    if name is not None:
        check_algorithms([name])  # a typo: one line at once, with the nearest name
    if name is None and not show:
        _list_algorithms(as_json)
        return
    from fedheads.algorithms import create_algorithm, list_algorithms
    from fedheads.run.settings import settings_json, settings_table

    names = [name] if name is not None else [i.name for i in list_algorithms()]
    if name is not None:
        create_algorithm(name)  # an unknown name: one line with the known ones
    if as_json:
        out = [settings_json(n) for n in names]
        click.echo(json.dumps(out[0] if name is not None else out, indent=2, default=str))
    else:
        click.echo("\n\n".join(settings_table(n) for n in names))


def _list_algorithms(as_json: bool) -> None:
    """The names and descriptions, read off the sources when they state them (no torch; a
    plugin's registrations, once imported, from the registry)."""
    import sys

    from fedheads.algorithm_names import declared

    rows = [(d.name, d.description) for d in declared()]
    if "fedheads.algorithms" in sys.modules or any(desc is None for _, desc in rows):
        from fedheads.algorithms import list_algorithms

        rows = [(i.name, i.description) for i in list_algorithms()]
    rows.sort()
    if as_json:
        click.echo(json.dumps([{"name": n, "description": d} for n, d in rows], indent=2))
        return
    for n, d in rows:
        click.echo(f"{n:16s} {d}")
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
