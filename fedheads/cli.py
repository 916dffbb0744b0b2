"""`fedheads` command line: train / compare / predict / finetune / feddra / algorithms / summarize, and
over Flower simulate / serve / join (fedheads.flower, imported only by those three).

Every command reads the feature store through `embedcache.store.reader` (numpy + zarr) and never
imports timm, torchvision or dask. Bad input prints one `error: ...` line and exits 2."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from embedcache.cli_base import UserErrorGroup
from embedcache.errors import UserError
from fedheads.run.options import config_options
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


def _csv(value: str, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise UserError(f"{what}: empty list")
    return items


def _seeds(value: str) -> tuple[int, ...]:
    from fedheads.run.checks import check_seeds

    try:
        seeds = tuple(int(s) for s in _csv(value, "--seeds"))
    except ValueError:
        raise UserError(f"--seeds {value!r}: expected comma-separated integers") from None
    check_seeds(seeds)
    return seeds


def _check_plain(ctx: click.Context, backbones: Sequence[str] = (),
                 store_backbones: tuple[str, Sequence[str]] | None = None, settings: Sequence[Any] = ()) -> Any:
    """What can be checked before torch (9-28 s on a busy machine) is imported: every number
    option finite (from a --config file too), the --set values, the seeds, and the names of
    backbones (`backbones`: registry names; `store_backbones`: (store, names) in that store).
    Returns the store it opened for that (the run reads it, not opened again), else None."""
    import math

    from embedcache.backbone_names import check_backbone_name
    from fedheads.run.checks import check_finite

    for p in ctx.command.params:
        v = ctx.params.get(str(p.name))
        if isinstance(v, float) and not math.isfinite(v):
            flag = next((o for o in p.opts if o.startswith("--")), str(p.name))
            raise UserError(f"{flag} {v}: must be a finite number")
    check_finite({"settings": settings})
    if "seeds" in ctx.params:
        _seeds(ctx.params["seeds"])
    for b in backbones:
        check_backbone_name(b)
    if store_backbones is not None:
        from embedcache.errors import did_you_mean
        from embedcache.store.reader import open_store

        store, names = store_backbones
        if not Path(store).exists():  # said by the run (--dump-config needs no store)
            return None
        info = open_store(store)
        for b in names:
            if b not in info.backbones:
                raise UserError(f"backbone {b!r}: not in store {info.path}{did_you_mean(b, info.backbones)} "
                                f"(has: {', '.join(info.backbones)})")
        return info
    return None


def _train_options(f):
    opts = [
        click.option("--store", required=True, type=click.Path(), help="Feature store (embedcache extract)."),
        click.option("--backbones", required=True, help="Comma-separated; features concatenated in this order."),
        click.option("--rounds", default=50, show_default=True, help="Communication rounds."),
        click.option("--seeds", default="0,1,2", show_default=True, help="Comma-separated seeds."),
        click.option("--local-epochs", type=int, default=None, help="Local epochs E (default: paper's)."),
        click.option("--batch-size", type=int, default=None, help="Local batch size (default: paper's)."),
        click.option("--lr", type=float, default=None, help="Client learning rate (default: paper's)."),
        click.option("--fraction", default=1.0, show_default=True, help="Client participation per round."),
        click.option("--engine", type=click.Choice(["vectorized", "loop"]), default="vectorized", show_default=True),
        click.option("--layout", type=click.Choice(["auto", "padded", "bucketed", "streamed"]), default="auto",
                     show_default=True,
                     help="Features padded to the largest client, or in size buckets (auto: when padding would cost; "
                          "streamed when they would take over half the memory available); streamed: buckets read "
                          "from the store as each round needs them (memory for one bucket)."),
        click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda"),
        click.option("--eval-every", default=1, show_default=True, help="Evaluate every k rounds (0: last only)."),
        click.option("--binarize", is_flag=True, help="FedPCL authors' 0/1 binarised backbone features."),
        click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
                     help="Algorithm config field, e.g. --set variant=code, or --set lp.lr=0.1 for one algorithm (repeatable)."),
        click.option("--tensorboard", is_flag=True,
                     help="Per-round scalars per seed in OUT/tensorboard/ (extra [tensorboard]; `tensorboard --logdir OUT`)."),
        click.option("--quiet", is_flag=True, help="No progress bars."),
        # a file given as --out gets the runner's one-line error, not click's usage block
        click.option("--out", required=True, type=click.Path(), help="Output directory."),
        click.option("--overwrite", is_flag=True,
                     help="Replace the run already in --out (its files only; default: refuse)."),
        click.option("--resume", is_flag=True,
                     help="Continue the interrupted run in --out from its per-round checkpoints (same settings)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _options(algorithms, backbones, store, rounds, seeds, local_epochs, batch_size, lr, fraction, engine, layout,
             device, eval_every, binarize, settings, quiet, tensorboard):
    """(TrainOptions, the store opened to check the backbone names or None), after every check
    that needs no torch (the names, the plain values)."""
    from fedheads.run.checks import check_algorithms
    from fedheads.run.options import merged_settings, parse_settings

    ctx = click.get_current_context()
    if rounds < 1:
        raise UserError(f"--rounds {rounds}: must be >= 1")
    check_algorithms(algorithms)
    fields = merged_settings(ctx, parse_settings(settings))
    info = _check_plain(ctx, store_backbones=(store, backbones), settings=fields)
    from fedheads.run.train import TrainOptions

    return info, TrainOptions(rounds=rounds, seeds=_seeds(seeds), fraction=fraction, engine=engine,
                        layout=layout, device=device, eval_every=eval_every, binarize=binarize,
                        local_epochs=local_epochs, batch_size=batch_size, lr=lr, settings=fields,
                        progress=not quiet, tensorboard=tensorboard)


def _dp_options(f):
    """--dp-*: differential privacy for the algorithms with a DP form (fedheads.privacy)."""
    opts = [
        click.option("--dp-epsilon", type=float, default=None,
                     help="Train under differential privacy, calibrated to spend at most this epsilon "
                          "(algorithms with a DP form: fedncm, fed3r, ccvr calibrating a saved head; "
                          "fedpft with --dp-mode local)."),
        click.option("--dp-noise-multiplier", type=float, default=None,
                     help="Or: the Gaussian noise multiplier z itself (epsilon is then reported)."),
        click.option("--dp-delta", type=float, default=1e-5, show_default=True, help="DP delta."),
        click.option("--dp-clip", type=float, default=1.0, show_default=True,
                     help="L2 bound C of each training feature."),
        click.option("--dp-transform", type=click.Choice(["clip", "normalize"]), default="clip", show_default=True,
                     help="Scale each feature to norm <= C (clip) or exactly C (normalize)."),
        click.option("--dp-mode", type=click.Choice(["central", "distributed", "local"]), default="central",
                     show_default=True, help="Noise added once by the server, or split over the clients (under "
                                             "SecAgg+), or by each client on its own statistics (fedpft)."),
        click.option("--dp-accountant", type=click.Choice(["rdp", "pld"]), default="rdp", show_default=True,
                     help="dp-accounting's accountant."),
        click.option("--dp-split", default=None, metavar="FIELD=W,...",
                     help="Budget split over the noised sums, e.g. sums=0.9,counts=0.1 (default: equal)."),
        click.option("--dp-noise-seed", type=int, default=None,
                     help="Reproducible noise (simulation only; default: a secret key from the OS)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _with_dp(opts: Any, values: dict[str, Any]) -> Any:
    """`opts` with the Mechanism the --dp-* option `values` ask for (none: no DP)."""
    import dataclasses

    from fedheads.privacy import from_cli

    dp = from_cli(**values)
    return opts if dp is None else dataclasses.replace(opts, dp=dp)


_MERGE = "\n\nOptions also come from --config FILE (YAML); merge order: built-in defaults < config file " \
         "< command-line flags (incl. --set). --dump-config prints the effective configuration."


@main.command(help=f"Train one algorithm over several seeds; write RUN_DIR/results.json and friends.{_MERGE}")
@click.option("--algorithm", required=True, help="See `fedheads algorithms`.")
@_train_options
@_dp_options
@config_options
def train(store, backbones, algorithm, out, overwrite, resume, dump_config, **kw) -> None:
    bbs = _csv(backbones, "--backbones")
    dp = {k: kw.pop(k) for k in [k for k in kw if k.startswith("dp_")]}
    info, opts = _options([algorithm], bbs, store, **kw)
    opts = _with_dp(opts, dp)
    from fedheads.run.allocator import GlibcHeap
    from fedheads.run.options import dump, effective_config
    from fedheads.run.train import train_run

    if dump_config:
        click.echo(dump("train", effective_config("train", store, bbs, [algorithm], opts, out)), nl=False)
        return
    # the store opened once for the whole run; this process's heap run the command's way (fedheads/run/allocator.py)
    res = train_run(store if info is None else info, bbs, algorithm, opts, out, overwrite=overwrite, resume=resume,
                    heap=GlibcHeap())
    click.echo(f"{algorithm}: accuracy {res['accuracy_cell']} over seeds {res['seeds']} -> {out}/results.json")


@main.command(help=f"Train several algorithms on the same features; write a paper-style table and plots.{_MERGE}")
@click.option("--algorithms", required=True, help="Comma-separated, e.g. fedpcl,fedncm,lp,mlp,fedavg,fedproto.")
@_train_options
@_dp_options
@config_options
def compare(store, backbones, algorithms, out, overwrite, resume, dump_config, **kw) -> None:
    bbs, names = _csv(backbones, "--backbones"), _csv(algorithms, "--algorithms")
    dp = {k: kw.pop(k) for k in [k for k in kw if k.startswith("dp_")]}
    info, opts = _options(names, bbs, store, **kw)
    opts = _with_dp(opts, dp)
    from fedheads.report import results as report
    from fedheads.run.allocator import GlibcHeap
    from fedheads.run.options import dump, effective_config
    from fedheads.run.train import check_compare_settings, compare_runs

    if dump_config:
        check_compare_settings(names, opts)
        click.echo(dump("compare", effective_config("compare", store, bbs, names, opts, out, strict=False)), nl=False)
        return
    res = compare_runs(store if info is None else info, bbs, names, opts, out, overwrite=overwrite, resume=resume,
                       heap=GlibcHeap())
    click.echo(report.comparison_markdown(list(res["algorithms"].values())))
    click.echo(f"report: {Path(out) / 'summary.md'}", err=True)


@main.command()
@click.option("--run", "run_dir", required=True, type=click.Path(file_okay=False), help="A `fedheads train` run directory.")
@click.option("--store", default=None, type=click.Path(), help="Features already extracted (one of --store/--manifest/--images).")
@click.option("--manifest", default=None, type=click.Path(), help="A manifest: its --split, each sample by its own client.")
@click.option("--images", default=None, metavar="imagefolder:PATH",
              help="New images; PATH/<class>/ or PATH/<domain>/<class>/ folders named like the run's classes give "
                   "labels (and accuracy). Classified by the global model, or --client.")
@click.option("--cache", default=None, type=click.Path(), help="Feature store for new images (default RUN_DIR/predict-cache).")
@click.option("--split", default=None, type=click.Choice(["train", "test"]), help="--store/--manifest: [default: test]")
@click.option("--client", default=None, help="A client name, or all (default: all; --images: the global model).")
@click.option("--seed", type=int, default=None, help="Which seed's state (default: the run's first).")
@click.option("--top-k", default=1, show_default=True, help="Also write the k nearest classes (capped at the classes).")
@click.option("--chunk-rows", default=65536, show_default=True, help="Rows per streamed chunk (bounded memory).")
@click.option("--device", default="cpu", show_default=True,
              help="Where extraction and the head run (faiss uses the GPU when it can).")
@click.option("--batch-size", type=int, default=None, help="Extraction batch (default: the training store's).")
@click.option("--num-workers", default=2, show_default=True, help="Image decoding threads.")
@click.option("--weights-dir", default=None, help="Where backbone weights are looked up first.")
@click.option("--plugin", "plugins", multiple=True, help="Module to import first (registers custom backbones).")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help=".csv or .parquet")
def predict(run_dir, out, quiet, **kw) -> None:
    """Classify samples with a trained run: stored features, a manifest, or new images (extracted
    with the run's backbones, checked against training's), by nearest prototype (faiss) or head."""
    from fedheads.api import predict as run_predict

    res = run_predict(run_dir, out=out, progress=not quiet, **kw)
    for line in res.accuracy_lines():
        click.echo(line)
    click.echo(f"{res.rows} predictions -> {out}")


def _live_run_options(f):
    """The run options every live command (finetune, feddra) shares: seeds, evaluation, device, loader,
    weights, resume / overwrite, progress and the run directory."""
    opts = [
        click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds."),
        click.option("--eval-every", default=1, show_default=True, help="Evaluate every k rounds (0: round 0 and last)."),
        click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N"),
        click.option("--num-workers", default=2, show_default=True, help="DataLoader workers for live images."),
        click.option("--weights-dir", default=None, help="Where backbone weights are looked up first."),
        click.option("--resume", is_flag=True, help="Continue from the last per-round checkpoint in --out."),
        click.option("--overwrite", is_flag=True, help="Replace a finished run in --out."),
        click.option("--quiet", is_flag=True, help="No progress bars."),
        click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _aliases(spec: dict[str, tuple[str, Any]]):
    """Hidden one-release aliases of options replaced by `--set KEY=VALUE`: {param: (key, value
    when the option is a flag, else None: the option's value)}. Each given (on the command line
    or in a --config file) prints one `note:` line naming its --set key (fedheads.cli._alias_settings)."""

    def deco(f):
        for name, (key, flag_value) in reversed(list(spec.items())):
            flag = "--" + name.replace("_", "-") if name != "steps" else "--steps-per-stage"
            decl = [flag] if name != "steps" else [flag, "steps"]
            if flag_value is not None:
                f = click.option(*decl, is_flag=True, hidden=True, help=f"Alias of --set {key}=...")(f)
            else:
                f = click.option(*decl, default=None, hidden=True, help=f"Alias of --set {key}=VALUE.")(f)
        return f

    return deco


def _alias_settings(ctx: click.Context, spec: dict[str, tuple[str, Any]], kw: dict[str, Any]) -> list[tuple[str, Any]]:
    """The (key, value) settings the alias options given stand for, each with its `note:` line;
    removes the aliases from `kw`."""
    from fedheads.run.options import parse_settings

    out = []
    for name, (key, flag_value) in spec.items():
        value = kw.pop(name, None)
        if value is None or value is False:
            continue
        flag = next(o for o in ctx.command.params if o.name == name).opts[0]
        if flag_value is not None:
            out.append((key, flag_value))
            shown = json.dumps(flag_value)
        else:
            out += list(parse_settings([f"{key}={value}"]))
            shown = str(value)
        click.echo(f"note: {flag} is now --set {key}={shown} ({flag} is kept for one release)", err=True)
    return out


def _method_settings(ctx: click.Context, spec: dict[str, tuple[str, Any]], kw: dict[str, Any],
                     settings: tuple[str, ...], preset: dict[str, Any] | None = None) -> tuple[tuple[str, Any], ...]:
    """The method's --set items, in merge order: a preset's values < the --config file's `set:`
    < the alias options < --set on the command line (later items win)."""
    from fedheads.run.options import merged_settings, parse_settings

    cli = tuple(_alias_settings(ctx, spec, kw)) + parse_settings(settings)
    return tuple((preset or {}).items()) + merged_settings(ctx, cli)


_SET_HELP = "Method setting (repeatable); --list-settings describes every key, --dump-config gives their values."


def _list_settings(module: str):
    """An eager --list-settings flag: the command's settings (key, type, default, doc [source],
    read from the config fields' metadata), then exit."""

    def show(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if not value or ctx.resilient_parsing:
            return
        import importlib

        from fedheads.run.options import command_settings, rows_table

        click.echo("\n".join(rows_table(command_settings(importlib.import_module(module).SETTINGS))))
        ctx.exit()

    return click.option("--list-settings", is_flag=True, is_eager=True, expose_value=False, callback=show,
                        help="Every --set key with its type, default, doc and paper source, and exit.")
# options that became --set keys: {param: (key, value of a flag)}
_FT_ALIASES: dict[str, tuple[str, Any]] = {
    **{k: (k, None) for k in ("head_rounds", "server", "server_lr", "server_momentum", "server_buffers", "prox_mu",
                              "lr", "warmup_rounds", "momentum", "weight_decay", "local_epochs", "batch_size",
                              "trainable", "bn")},
    "live_prefix": ("live_prefix", True), "no_pretrained": ("pretrained", False), "no_augment": ("augment", False)}


@main.command()
@click.option("--manifest", "manifest_path", required=True, type=click.Path(), help="The manifest the store was extracted from.")
@click.option("--store", required=True, type=click.Path(), help="Feature store with the backbone's features (and B@CUT maps).")
@click.option("--backbone", required=True, help="Trainable backbone, e.g. resnet20-cifar10 (see `embedcache backbones`).")
@click.option("--head", "heads", default="fedncm", show_default=True,
              help="Stage 1, comma-separated for a comparison: fedncm (FedNCM+FT) | fed3r (Fed3R+FT) | "
                   "fedcof (FedCOF+FT) | lp (LP+FT) | random (FT).")
@click.option("--rounds", default=10, show_default=True, help="Fine-tuning rounds.")
@click.option("--fraction", default=1.0, show_default=True, help="Client participation per round.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="e.g. --set server=fedadam --set lr=0.01 --set trainable=after:layer2. " + _SET_HELP)
@_list_settings("fedheads.finetuning.runner")
@_aliases(_FT_ALIASES)
@_live_run_options
@config_options
@click.pass_context
def finetune(ctx, dump_config, manifest_path, store, backbone, heads, rounds, fraction, settings, seeds, eval_every,
             device, num_workers, weights_dir, resume, overwrite, quiet, out, **aliases) -> None:
    """Fine-tune a backbone federatedly from a stage-1 head computed on the store (FedNCM+FT, LP+FT, FT).

    Method settings (the server and client optimisers, stage-1 LP rounds, which blocks train, BatchNorm,
    augmentation) are --set KEY=VALUE. Options also come from --config FILE (YAML or JSON; defaults < file <
    command-line flags); --dump-config prints the effective configuration, every setting included."""
    from fedheads.run.checks import check_finetune_heads

    names = _csv(heads, "--head")
    if not dump_config:  # a dump is written as given, checked when it is run
        check_finetune_heads(names)
        _check_plain(ctx, backbones=[backbone])
    fields = _method_settings(ctx, _FT_ALIASES, aliases, settings)
    from fedheads.finetuning.runner import finetune_options, finetune_run, finetune_settings

    opts = finetune_options(fields, heads=tuple(names), rounds=rounds, fraction=fraction, seeds=_seeds(seeds),
                            eval_every=eval_every, device=device, num_workers=num_workers, weights_dir=weights_dir,
                            resume=resume, overwrite=overwrite, progress=not quiet)
    if dump_config:
        from fedheads.run.options import dump, params_config

        click.echo(dump("finetune", {**params_config(ctx), "set": finetune_settings(opts)}), nl=False)
        return
    res = finetune_run(manifest_path, str(store), backbone, out, opts)
    for r in res.get("algorithms", {"": res}).values():
        click.echo(f"{r['algorithm']}: accuracy {r['accuracy_cell']} after {r['rounds']} rounds "
                   f"(round 0: {r['figure1'][0]['accuracy']:.2f})")
    click.echo(f"report: {Path(out) / 'summary.md'}", err=True)


def _flower_options(f):
    """Options of a federated run over Flower (`serve`, `simulate`): fedheads.flower.run_config.FlowerRunConfig."""
    opts = [
        click.option("--algorithm", required=True, help="See `fedheads algorithms`."),
        click.option("--backbones", required=True, help="Comma-separated; every node concatenates them in this order."),
        click.option("--rounds", default=1, show_default=True, help="Communication rounds."),
        click.option("--seed", default=0, show_default=True, help="Run seed (participants, initialisations, batches)."),
        click.option("--fraction", default=1.0, show_default=True, help="Client participation per round."),
        click.option("--eval-every", default=1, show_default=True, help="Evaluate every k rounds (0: last only)."),
        click.option("--local-epochs", type=int, default=0, help="Local epochs E (default: paper's)."),
        click.option("--batch-size", type=int, default=0, help="Local batch size (default: paper's)."),
        click.option("--lr", type=float, default=0.0, help="Client learning rate (default: paper's)."),
        click.option("--binarize", is_flag=True, help="FedPCL authors' 0/1 binarised backbone features."),
        click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help="Algorithm config field (repeatable)."),
        click.option("--secagg", is_flag=True, help="SecAgg+ for the sum-shaped server steps (fedncm, fed3r, fedproto, fedpcl)."),
        click.option("--secagg-shares", default=1.0, show_default=True, help="SecAgg+ shares, fraction of the participants."),
        click.option("--secagg-threshold", default=0.67, show_default=True,
                     help="SecAgg+ reconstruction threshold, fraction of the shares."),
        click.option("--on-dropout", type=click.Choice(["refuse", "continue"]), default="refuse", show_default=True,
                     help="A node failing a round: stop the run, or complete the round from the others (recorded)."),
        click.option("--timeout", default=600.0, show_default=True, help="Seconds a round's messages may take."),
        click.option("--out", required=True, type=click.Path(file_okay=False), help="Run directory (results.json ...)."),
        click.option("--overwrite", is_flag=True, help="Replace the run already in --out."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _flower_config(settings, out, **kw):
    """The run config of `serve` / `simulate`; the --dp-* options (train's) become its dp_* fields,
    checked here, and an algorithm without a DP form is refused before any server starts."""
    from fedheads.run.checks import check_algorithms
    from fedheads.run.options import parse_settings

    check_algorithms([kw["algorithm"]])
    fields = parse_settings(settings)
    _check_plain(click.get_current_context(), settings=fields)
    from fedheads.privacy import from_cli  # (torch) after the typo checks

    dp = {k: kw.pop(k) for k in [k for k in kw if k.startswith("dp_")]}
    mech = from_cli(**dp, dp_noise_seed=None)  # one line for values that are not a mechanism
    from fedheads.flower import require_flower
    from fedheads.flower.run_config import FlowerRunConfig

    require_flower()  # one line without the extra, before anything is written
    cfg = FlowerRunConfig(settings=json.dumps([list(p) for p in fields]), out=str(Path(out).resolve()),
                          **{**dp, "dp_epsilon": dp["dp_epsilon"] or 0.0,
                             "dp_noise_multiplier": dp["dp_noise_multiplier"] or 0.0, "dp_split": dp["dp_split"] or ""},
                          **kw)
    if mech is not None:
        from fedheads.flower.loop import build

        build(cfg)  # the server's algorithm under the mechanism: refuses one without a DP form
    return cfg


def _flower_summary(res: dict, out: str) -> None:
    """One line; the node count is that of the accuracy mean (nodes evaluated), dropped ones named."""
    fl = res.get("flower", {})
    over = sum(1 for v in res.get("per_client", {}).values() if v.get("mean") is not None)
    dropped = res.get("clients_dropped") or []
    click.echo(f"{res['algorithm']} over Flower ({res['engine']}): accuracy {res['accuracy_cell']} over {over} of "
               f"{len(fl.get('nodes', {}))} nodes" + (f" ({', '.join(dropped)} dropped)" if dropped else "")
               + f", {fl.get('sent_bytes', 0) + fl.get('received_bytes', 0):,} bytes -> {out}/results.json")


@main.command()
@click.option("--store", required=True, type=click.Path(), help="Feature store; one virtual node per client.")
@click.option("--clients", default="", help="Comma-separated subset/order of the store's clients (default: all).")
@_flower_options
@_dp_options
def simulate(store, clients, dp_noise_seed, **kw) -> None:
    """Run an algorithm over Flower's simulation runtime in this process (same results as `train`)."""
    from fedheads.flower.sim import flower_logs, simulate_store
    from fedheads.run import rundir

    cfg = _flower_config(clients=clients, **kw)
    with rundir.locked(Path(cfg.out)):  # one run writes --out at a time, as for `train`
        # before flower.log is written there: an existing run is refused untouched
        rundir.refuse_existing(Path(cfg.out), overwrite=cfg.overwrite)
        with flower_logs(Path(cfg.out) / "flower.log", lambda m: click.echo(m, err=True)):
            simulate_store(cfg, store, [c for c in clients.split(",") if c] or None, noise_seed=dp_noise_seed)
    _flower_summary(json.loads((Path(cfg.out) / "results.json").read_text()), cfg.out)


@main.command()
@click.option("--nodes", required=True, type=int, help="Wait for this many SuperNodes (fedheads join), then run.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the SuperLink binds (loopback for a local trial).")
@click.option("--port", default=0, help="SuperLink port (default: a free one, printed).")
@click.option("--wait", default=600.0, show_default=True, help="Seconds to wait for the nodes.")
@click.option("--ssl-certfile", default=None, help="TLS certificate (a real deployment; else --insecure is used).")
@click.option("--ssl-keyfile", default=None, help="TLS private key.")
@click.option("--ssl-ca-certfile", default=None, help="TLS CA certificate (give it to the nodes as --root-certificates).")
@_flower_options
@_dp_options
def serve(nodes, host, port, wait, ssl_certfile, ssl_keyfile, ssl_ca_certfile, dp_noise_seed, **kw) -> None:
    """Start a Flower SuperLink, run an algorithm over the nodes that join, write --out (with
    --dp-*: under differential privacy, docs/flower.md)."""
    if dp_noise_seed is not None:
        raise UserError(f"--dp-noise-seed {dp_noise_seed}: simulation only (`fedheads simulate`); in a deployment the "
                        "server and every node draw their own secret noise key")
    cfg = _flower_config(nodes=nodes, wait=wait, **kw)
    if cfg.dp_mode == "distributed" and not cfg.secagg and cfg.mechanism() is not None:
        click.echo("note: --dp-mode distributed without --secagg: the server sees each node's sums with only "
                   "its share of the noise (docs/flower.md)", err=True)
    from fedheads.flower.deploy import serve as run_serve

    tls = None
    if any((ssl_certfile, ssl_keyfile, ssl_ca_certfile)):
        if not all((ssl_certfile, ssl_keyfile, ssl_ca_certfile)):
            raise UserError("--ssl-certfile/--ssl-keyfile/--ssl-ca-certfile: give all three (or none: insecure)")
        tls = {"certfile": ssl_certfile, "keyfile": ssl_keyfile, "ca": ssl_ca_certfile}
    from fedheads.run import rundir

    with rundir.locked(Path(cfg.out)):  # one run writes --out at a time, as for `train`
        res = run_serve(cfg.to_run_config(), Path(cfg.out), host=host, port=port, tls=tls,
                        timeout=wait + cfg.timeout * (cfg.rounds + 2), echo=lambda m: click.echo(m, err=True))
    _flower_summary(res, cfg.out)


@main.command()
@click.option("--superlink", required=True, help="HOST:PORT of the SuperLink (`fedheads serve` prints it).")
@click.option("--store", required=True, type=click.Path(), help="This node's own feature store.")
@click.option("--client", default="", help="Which client of the store / manifest this node is (default: the only one).")
@click.option("--manifest", default="", type=click.Path(), help="This node's images: extracted into --store on first use.")
@click.option("--device", default="cpu", show_default=True, help="Where the head runs (and extraction).")
@click.option("--weights-dir", default="", help="Backbone weights for the extraction.")
@click.option("--port", default=0, help="Local port of the node's ClientApp API (default: a free one).")
@click.option("--root-certificates", default=None, help="CA certificate of a TLS SuperLink (default: insecure).")
@click.option("--log", "log_path", default="", help="Where the SuperNode's output goes (default: STORE.flower.log "
              "beside the store; '-': this console).")
def join(superlink, store, client, manifest, device, weights_dir, port, root_certificates, log_path) -> None:
    """Run a Flower SuperNode for this node's own data until the SuperLink goes away."""
    import os

    from fedheads.flower.deploy import join_command

    node = {"store": str(Path(store).resolve()), "client": client, "device": device,
            "manifest": str(Path(manifest).resolve()) if manifest else "", "weights-dir": weights_dir}
    cmd, env = join_command(superlink, node, Path(store).resolve().parent / f".{Path(store).name}.flower", port,
                            insecure=root_certificates is None, root_certificates=root_certificates)
    Path(node["store"]).parent.mkdir(parents=True, exist_ok=True)
    log = None if log_path == "-" else Path(log_path or Path(store).with_name(Path(store).name + ".flower.log"))
    click.echo(f"joining {superlink} as {client or Path(store).name} (SuperNode, this PID"
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


_FD_ALIASES: dict[str, tuple[str, Any]] = {
    **{k: (k, None) for k in ("schedule", "stage1_rounds", "steps", "batch_size", "rho", "divergence",
                              "radius_convention", "gamma", "mu", "tau", "lr", "encoder_lr", "weight_decay",
                              "step_scaling", "aggregation", "dro_loss", "dro_model", "dro_batches", "prox_mu",
                              "image_trainable", "text_trainable", "bn", "stage1_inputs")},
    "no_two_stage": ("two_stage", False), "no_augment": ("augment", False)}


@main.command()
@click.option("--manifest", "manifest_path", required=True, type=click.Path(), help="A paired (image, text) manifest.")
@click.option("--store", default=None, type=click.Path(),
              help="Store with the encoders' token states (IMAGE@CUT maps, TEXT@CUT token shards): stage 1 reads them; "
                   "without it stage 1 encodes live.")
@click.option("--image-encoder", required=True, help="Trainable image backbone, e.g. resnet20-cifar10, efficientnet-lite0:160.")
@click.option("--image-cut", default=None, help="Image token states after this stage (default: its last map; Lite0 blocks.6).")
@click.option("--text-encoder", required=True, help="Text backbone, e.g. minilm-l6-v2:32 (T = 32 tokens).")
@click.option("--text-cut", default=None, help="Text token states after this stage (default: its last layer, layer.5).")
@click.option("--baseline", "baselines", default="feddra", show_default=True,
              help="Comma-separated presets: feddra, fedavg (the paper's: one stage), fedavg-two-stage, fedprox, "
                   "no-two-stage, no-constraint, no-dro.")
@click.option("--preset", type=click.Choice(["paper", "quick"]), default="paper", show_default=True,
              help="Defaults of the settings not given: paper (25 rounds x 50 steps, both encoders train) or quick "
                   "(4 rounds x 5 steps at batch 32, text encoder frozen: minutes on 2 CPU cores).")
@click.option("--rounds", default=25, show_default=True, help="Communication rounds (paper: 25).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="e.g. --set rho=0.1 --set mu=1 --set steps=50 --set schedule=sequential. " + _SET_HELP)
@click.option("--probe-manifest", default=None, type=click.Path(), help="Out-of-distribution manifest for the few-shot probe.")
@click.option("--probe-shots", default="1,5", show_default=True, help="Labelled images per class, comma-separated.")
@click.option("--probe-draws", default=5, show_default=True)
@_list_settings("fedheads.feddra.runner")
@_aliases(_FD_ALIASES)
@_live_run_options
@config_options
@click.pass_context
def feddra(ctx, dump_config, manifest_path, store, image_encoder, image_cut, text_encoder, text_cut, baselines, preset,
           rounds, settings, probe_manifest, probe_shots, probe_draws, seeds, eval_every, device, num_workers,
           weights_dir, resume, overwrite, quiet, out, **aliases) -> None:
    """FedDRA (federated distributionally robust vision-language alignment) and its baselines.

    Method settings (DRO radius and divergence, the constraint weight mu, local steps, learning rates, the
    schedule, which encoder blocks train) are --set KEY=VALUE. Options also come from --config FILE (YAML or
    JSON; defaults < preset < file < command-line flags); --dump-config prints the effective configuration,
    every setting included (the preset's values resolved)."""
    from fedheads.run.checks import FEDDRA_BASELINES, check_choices

    if not dump_config:  # a dump is written as given, checked when it is run
        check_choices(_csv(baselines, "--baseline"), FEDDRA_BASELINES, "baseline", "--baseline")
        _check_plain(ctx, backbones=[image_encoder, text_encoder])
    from fedheads.feddra.probe import ProbeOptions
    from fedheads.feddra.runner import PRESETS, feddra_options, feddra_run, feddra_settings, summary_line

    chosen = dict(PRESETS[preset])
    if ctx.get_parameter_source("rounds") is click.core.ParameterSource.DEFAULT:
        rounds = chosen.get("rounds", rounds)
    chosen.pop("rounds", None)
    fields = _method_settings(ctx, _FD_ALIASES, aliases, settings, preset=chosen)
    probe = None
    if probe_manifest:
        try:
            shots = tuple(int(k) for k in _csv(probe_shots, "--probe-shots"))
        except ValueError:
            raise UserError(f"--probe-shots {probe_shots!r}: expected comma-separated integers") from None
        probe = ProbeOptions(manifest=probe_manifest, shots=shots, draws=probe_draws)
    opts = feddra_options(fields, rounds=rounds, baselines=tuple(_csv(baselines, "--baseline")), image_cut=image_cut,
                          text_cut=text_cut, probe=probe, seeds=_seeds(seeds), eval_every=eval_every, device=device,
                          num_workers=num_workers, weights_dir=weights_dir, resume=resume, overwrite=overwrite,
                          progress=not quiet)
    if dump_config:  # the preset's values resolved, so the file means the same under any preset
        from fedheads.run.options import dump, params_config

        click.echo(dump("feddra", {**params_config(ctx, {**ctx.params, "rounds": rounds}),
                                   "set": feddra_settings(opts)}), nl=False)
        return
    res = feddra_run(manifest_path, store, image_encoder, text_encoder, out, opts)
    for r in res.get("algorithms", {"": res}).values():
        click.echo(summary_line(r))
    click.echo(f"report: {Path(out) / 'summary.md'}", err=True)


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
    from fedheads.run.options import settings_json, settings_table

    infos = list_algorithms()
    if name is not None or show:
        names = [name] if name is not None else [i.name for i in infos]
        if name is not None:
            create_algorithm(name)  # an unknown name: one line with the known ones
        if as_json:
            out = [settings_json(n) for n in names]
            click.echo(json.dumps(out[0] if name is not None else out, indent=2, default=str))
        else:
            click.echo("\n\n".join(settings_table(n) for n in names))
        return


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
