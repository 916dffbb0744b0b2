"""Config files for the `fedheads` commands: `--config run.yaml` (or run.json) and `--dump-config`.

Merge order: built-in defaults < the config file < command-line flags (incl. --set). The file is
read by click itself: its values become the command's `default_map`, so a flag typed on the command
line wins as it would over any default. Its keys are the command's long option names (`-` or `_`),
plus `set:` (a mapping of the method's settings: algorithm config fields for train/compare, the
fine-tuning or FedDRA settings for finetune/feddra; merged key by key with --set: a key given on
the command line, or by --lr / --batch-size / --local-epochs, replaces the file's) and `command:`
(the command it was written for). A `.json` file is read as strict JSON, anything else as YAML.
Unknown keys and values of the wrong type are one `error:` line.

`--dump-config` prints the effective configuration as YAML and exits; `fedheads train ...
--dump-config > run.yaml; fedheads train --config run.yaml` runs the same thing. `train` and
`compare` also keep it in RUN_DIR/config.yaml (docs/contracts.md, 6)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from embedcache.errors import UserError

OPERATIONAL = ("config", "dump_config", "list_settings", "overwrite", "resume", "quiet")  # how to run, not what: never in a file
LIST_PARAMS = ("backbones", "seeds", "algorithms", "heads", "baselines", "probe_shots")  # comma lists on the CLI
SETTINGS_PARAM = "settings"  # --set, the file's `set:`
META = "fedheads.config_settings"  # ctx.meta key: the file's `set:` entries
HEADER = ("# fedheads {command}: the effective configuration (fedheads {command} --config FILE runs it again).\n"
          "# Merge order: built-in defaults < this file < command-line flags.\n")


def key_of(param: click.Parameter) -> str:
    """The file key of an option: its long name without dashes, `_` for `-` (--head -> head)."""
    longs = [o for o in param.opts if o.startswith("--")]
    return (longs[0][2:] if longs else str(param.name)).replace("-", "_")


def _file_params(command: click.Command, aliases: bool = False) -> dict[str, click.Parameter]:
    """{file key: option}; `aliases`: with the hidden one-release aliases of options that became
    --set keys (read from a file written before, never written)."""
    return {key_of(p): p for p in command.params if p.name not in OPERATIONAL and isinstance(p, click.Option)
            and (aliases or not p.hidden)}


def _expected(param: click.Parameter) -> str:
    t = param.type
    if isinstance(t, click.Choice):
        return "one of " + " | ".join(map(str, t.choices))
    if param.name in LIST_PARAMS:
        return "a list (or comma-separated text)"
    for cls, what in ((click.types.BoolParamType, "true or false"), (click.types.IntParamType, "an integer"),
                      (click.types.FloatParamType, "a number")):
        if isinstance(t, cls):
            return what
    return "text"


def _value(param: click.Parameter, key: str, value: Any, path: str) -> Any:
    """The file's value as the command line would pass it, or one UserError line naming the key."""
    if value is None and param.default is None and not param.required:
        return None
    if getattr(param, "hidden", False) and not isinstance(param.type, click.types.BoolParamType):
        return value  # an alias of a --set key: its value is parsed as --set parses it
    t, ok = param.type, False
    if param.name in LIST_PARAMS and isinstance(value, (list, tuple, int, str)) and not isinstance(value, bool):
        items = value if isinstance(value, (list, tuple)) else [value]
        if all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in items):
            return ",".join(str(v) for v in items)
    elif isinstance(t, click.Choice):
        ok = value in t.choices
    elif isinstance(t, click.types.BoolParamType):
        ok = isinstance(value, bool)
    elif isinstance(t, click.types.IntParamType):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(t, click.types.FloatParamType):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
    if not ok:
        raise UserError(f"{path}: {key}: expected {_expected(param)}, got {value!r}")
    return value


def read_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--config's callback (eager: it runs before the other options are read)."""
    if value is None:
        return None
    import json

    import yaml

    from embedcache.parsing import loads_json, loads_yaml

    try:
        text = Path(value).read_text()
        if value.lower().endswith(".json"):
            doc = loads_json(text, f"--config {value}")
        else:
            doc = loads_yaml(text, f"--config {value}")
    except json.JSONDecodeError as exc:
        raise UserError(f"--config {value}: not valid JSON at line {exc.lineno} ({exc.msg})") from None
    except OSError as exc:
        raise UserError(f"--config {value}: cannot read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"--config {value}: not valid YAML{where} ({getattr(exc, 'problem', None) or exc})") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise UserError(f"--config {value}: expected a mapping of option: value, got {type(doc).__name__}")
    cmd = ctx.command
    params = _file_params(cmd, aliases=True)
    dm: dict[str, Any] = {}
    for raw, v in doc.items():
        key = str(raw).replace("-", "_")
        if key == "command":
            if v != cmd.name:
                raise UserError(f"{value}: written for `fedheads {v}`, not `fedheads {cmd.name}`")
        elif key == "set" and any(p.name == SETTINGS_PARAM for p in params.values()):
            if not isinstance(v, dict):
                raise UserError(f"{value}: set: expected a mapping of algorithm config fields, got {v!r}")
            ctx.meta[META] = [(str(k).replace("-", "_"), x) for k, x in v.items()]
        elif key in params and params[key].name != SETTINGS_PARAM:
            dm[str(params[key].name)] = _value(params[key], key, v, value)
        else:
            valid = sorted(k for k, p in params.items() if p.name != SETTINGS_PARAM and not p.hidden)
            if any(p.name == SETTINGS_PARAM for p in params.values()):
                valid.append("set")
            raise UserError(f"{value}: unknown key {raw!r} for `fedheads {cmd.name}` (valid keys: command, "
                            f"{', '.join(valid)})")
    ctx.default_map = {**(ctx.default_map or {}), **dm}
    return value


def config_options(f: Callable) -> Callable:
    """Add --config and --dump-config to a command (the command receives `dump_config`)."""
    f = click.option("--dump-config", is_flag=True,
                     help="Print the effective configuration as YAML (every option, and under set: every "
                          "setting of the method with its value) and exit.")(f)
    f = click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
                     callback=read_config,
                     help="YAML or JSON file of options (keys: the long option names, and set: for the "
                          "method's settings). Merge order: defaults < config file < command-line flags (incl. --set).")(f)
    return f


def merged_settings(ctx: click.Context, cli: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """The file's `set:` entries, minus those the command line replaces (a --set of the same key,
    plain or scoped, or a --lr / --batch-size / --local-epochs flag), then the command line's."""
    given = {k for k, _ in cli}
    for name in ("lr", "batch_size", "local_epochs"):
        if name in ctx.params and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            given.add(name)
    plain = {k for k in given if "." not in k}
    kept = [(k, v) for k, v in ctx.meta.get(META, [])
            if k not in given and k.rpartition(".")[2] not in plain]
    return tuple(kept) + tuple(cli)


def dump(command: str, values: dict[str, Any]) -> str:
    """YAML text of an effective configuration, keys in the order given."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    # lists on one line ([0, 1, 2]), mappings one key per line (set: is read and diffed by people)
    Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    body = yaml.dump({"command": command, **values}, Dumper=Dumper, sort_keys=False, default_flow_style=False,
                     width=100)
    return HEADER.format(command=command) + body


def params_config(ctx: click.Context, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """A command's configuration from its option values (`values`: resolved ones, default
    ctx.params), keyed as in a file; comma lists as YAML lists."""
    values = ctx.params if values is None else values
    out: dict[str, Any] = {}
    for key, p in _file_params(ctx.command).items():
        v = values.get(str(p.name))
        if p.name in LIST_PARAMS and isinstance(v, str):
            v = [int(x) if x.strip().lstrip("-").isdigit() and p.name in ("seeds", "probe_shots") else x.strip()
                 for x in v.split(",") if x.strip()]
        out[key] = list(v) if isinstance(v, tuple) else v
    return out


def effective_config(command: str, store: str | None, backbones: list[str], algorithms: list[str], opts: Any,
                     out: str | Path, strict: bool = True, dropped: tuple[str, ...] = (),
                     configs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The effective configuration of `fedheads train` (one algorithm) or `compare`, keyed like
    their options (tests/test_runconfig.py checks the two match): `set` holds every config field
    of the algorithm (compare: `NAME.field` for each) as it is built, defaults included.
    `dropped`: generic options a comparison did not apply to this algorithm (left out).
    `configs`: {algorithm: the config it was built with} (else each is built once here)."""
    from fedheads.run.train import build_algorithm
    from fedheads.run.options import resolved_settings

    cfg: dict[str, Any] = {"store": store, "backbones": list(backbones)}
    if command == "train":
        cfg["algorithm"] = algorithms[0]
    else:
        cfg["algorithms"] = list(algorithms)
    generic = {k: None if k in dropped else getattr(opts, k) for k in opts.generic_names}
    cfg.update({"rounds": opts.rounds, "seeds": list(opts.seeds), **generic, "fraction": opts.fraction,
                "engine": opts.engine, "layout": opts.layout, "device": opts.device, "eval_every": opts.eval_every,
                "binarize": opts.binarize, "tensorboard": opts.tensorboard, "out": str(out)})
    from fedheads.privacy import cli_values

    cfg.update(cli_values(getattr(opts, "dp", None)))  # --dp-* (fedheads.privacy)
    fields: dict[str, Any] = {}
    for name in algorithms:
        built = (configs or {}).get(name)
        if built is None:
            built = build_algorithm(name, opts, strict=strict)[0]
        prefix = "" if command == "train" else f"{name}."
        fields.update({prefix + k: v for k, v in resolved_settings(name, built).items()})
    cfg["set"] = fields
    return cfg
