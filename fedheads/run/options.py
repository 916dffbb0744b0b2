"""What `--set KEY=VALUE` (and `settings=` in the Python API) can change, read off the
algorithm's declared config dataclass (`register_algorithm(..., config=...)`): every field with
its type, default, and the one-line doc and paper source that fedheads.core.config.setting
records in the field's metadata. `fedheads algorithms NAME` prints it; `--set`, `--config` and
`--dump-config` check and write the same keys; an unknown key's error lists them.

The client optimiser is one nested field (`optimizer`); the registry takes its parts as flat keys
(`lr`, `weight_decay`, `momentum`, `optimizer_name`: fedheads.core.optim.config_from_kwargs), so
they are listed flat, with the algorithm's own optimiser defaults. Fields the registration fixes
(lp's `hidden`) are not keys.

Config files for the `fedheads` commands: `--config run.yaml` (or run.json) and `--dump-config`.

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
`compare` also keep it in RUN_DIR/config.yaml (docs/contracts.md, 6).

The algorithm of a run is built here, once, from those settings (build_algorithm)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from embedcache.errors import UserError
from embedcache.parsing import loads_json

OPT_FIELD = "optimizer"


def setting_doc(f: dataclasses.Field) -> tuple[str, str]:
    """(doc, source) of a config field (fedheads.core.config.setting_doc; imported when called,
    so that checking a typed name on the command line does not load torch with fedheads.core)."""
    from fedheads.core.config import setting_doc as read

    return read(f)


@dataclass(frozen=True)
class Setting:
    """One settable key of an algorithm."""

    key: str  # what --set takes
    type: str  # the field's annotation
    default: Any  # the algorithm's default value
    doc: str  # the field's doc (its `setting` metadata)
    source: str  # the paper passage(s) it comes from ("" when none)


def parse_settings(items: Iterable[str]) -> tuple[tuple[str, Any], ...]:
    """`key=value` strings -> ((key, value), ...); values parsed as JSON when they parse."""
    out = []
    for it in items:
        if "=" not in it:
            raise UserError(f"--set {it!r}: expected key=value")
        k, v = it.split("=", 1)
        try:
            val: Any = loads_json(v, f"--set {k.strip()}")  # a key twice in a JSON value is refused
        except json.JSONDecodeError:
            val = v
        out.append((k.strip().replace("-", "_"), val))
    return tuple(out)


_UNDECLARED: dict[tuple[str, int], type | None] = {}


def config_class(name: str) -> type | None:
    """The config dataclass of algorithm `name`: declared at registration; for an algorithm
    registered without one, the class of one default build's `cfg` (built once, remembered).
    None: an algorithm without a config dataclass (no keys). UserError for an unknown name."""
    from fedheads.algorithms import algorithm_info, create_algorithm

    info = algorithm_info(name)
    if info.config is not None:
        return info.config
    key = (name, id(info.factory))
    if key not in _UNDECLARED:
        cfg = getattr(create_algorithm(name), "cfg", None)
        _UNDECLARED[key] = type(cfg) if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) else None
    return _UNDECLARED[key]


def _defaults(cls: type) -> Any:
    """A default instance of `cls` (its checks applied), or its fields' declared defaults where a
    field has none (None there)."""
    fields = dataclasses.fields(cls)
    missing = dataclasses.MISSING
    if all(f.default is not missing or f.default_factory is not missing for f in fields):
        return cls()
    return type("Defaults", (), {f.name: f.default if f.default is not missing else
                                 f.default_factory() if f.default_factory is not missing else None  # type: ignore[misc]
                                 for f in fields})()


def settings_of(name: str) -> tuple[list[Setting], str]:
    """(every key `--set` takes for algorithm `name`, the config class docstring), read from the
    declared config class and its fields' metadata (nothing is built). UserError for an unknown
    algorithm; an algorithm without a config dataclass has no keys."""
    from fedheads.algorithms import algorithm_info

    cls = config_class(name)
    if cls is None:
        return [], ""
    fixed = algorithm_info(name).fixed
    base = _defaults(cls)
    fields = dataclasses.fields(cls)
    own = {f.name for f in fields}
    out: list[Setting] = []
    for f in fields:
        if f.name in fixed:
            continue
        value = getattr(base, f.name)
        doc, source = setting_doc(f)
        if f.name == OPT_FIELD and dataclasses.is_dataclass(value):
            out += _optimizer_settings(value, doc, source, own)
            continue
        out.append(Setting(f.name, str(f.type), value, doc, source))
    return sorted(out, key=lambda s: s.key), inspect.cleandoc(cls.__doc__ or "")


def _optimizer_settings(opt: Any, doc: str, source: str, own: set[str]) -> list[Setting]:
    """The flat keys of the nested optimiser field, documented by the optimiser's own fields;
    the algorithm's doc and source on that field say where its optimiser defaults come from."""
    from fedheads.core.optim import _OPT_KEYS

    parts = {f.name: f for f in dataclasses.fields(opt)}
    out = []
    for key, part in _OPT_KEYS.items():
        if key in own:  # the config's own field wins (pFedMe's `lr`)
            continue
        pdoc, psource = setting_doc(parts[part])
        full = f"client optimiser: {pdoc}" + (f" (this algorithm: {doc})" if doc else "")
        value = getattr(opt, part)
        # the optimiser's own source describes its own default only
        own_source = psource if value == getattr(type(opt)(), part) else ""
        out.append(Setting(key, str(parts[part].type), value, full, source or own_source))
    return out


def valid_keys(name: str) -> list[str]:
    return [s.key for s in settings_of(name)[0]]


def unknown_key_error(key: str, names: list[str], flag: str | None = None) -> UserError:
    """One line: the key is not a setting of these algorithms, and the keys that are."""
    import difflib

    keys = sorted({k for n in names for k in valid_keys(n)})
    what = flag or f"--set {key}"
    near = difflib.get_close_matches(key, keys, n=1)
    hint = f"did you mean {near[0]}? " if near else ""
    return UserError(f"{what}: not a setting of {', '.join(names)} ({hint}valid keys: {', '.join(keys) or 'none'}; "
                     f"`fedheads algorithms {names[0]}` describes them)")


def _fmt(v: Any) -> str:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return f"{type(v).__name__}(...)"
    return repr(v)


def settings_table(name: str) -> str:
    """The text `fedheads algorithms NAME` prints."""
    from fedheads.algorithms import list_algorithms

    info = next((i for i in list_algorithms() if i.name == name), None)
    rows, doc = settings_of(name)
    head = [f"{name}: {info.description if info else ''}"]
    if doc:
        head += ["", *("  " + ln for ln in doc.splitlines())]
    if not rows:
        return "\n".join(head + ["", "no settings"])
    lines = ["", *rows_table(rows)]
    generic = [f"--{k.replace('_', '-')}" for k in ("lr", "batch_size", "local_epochs") if k in {r.key for r in rows}]
    also = f"; {'/'.join(generic)} set the key{'s' if len(generic) > 1 else ''} of that name" if generic else ""
    return "\n".join(head + lines + ["", f"set with --set KEY=VALUE (or --set {name}.KEY=VALUE in compare){also}"])


def rows_table(rows: list[Setting]) -> list[str]:
    """Lines of a settings table: key, type, default, doc [source]."""
    w = [max(len(c) for c in col) for col in zip(*[("key", "type", "default")] +
                                                     [(r.key, r.type, _fmt(r.default)) for r in rows])]
    lines = [f"{'key':{w[0]}}  {'type':{w[1]}}  {'default':{w[2]}}  doc [source]"]
    for r in rows:
        src = f" [{r.source}]" if r.source else ""
        lines.append(f"{r.key:{w[0]}}  {r.type:{w[1]}}  {_fmt(r.default):{w[2]}}  {r.doc}{src}")
    return lines


def settings_json(name: str) -> dict[str, Any]:
    rows, doc = settings_of(name)
    return {"name": name, "doc": doc,
            "settings": [{"key": r.key, "type": r.type, "default": r.default if not dataclasses.is_dataclass(r.default)
                          else dataclasses.asdict(r.default), "doc": r.doc, "source": r.source} for r in rows]}


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def resolved_settings(name: str, config: Any) -> dict[str, Any]:
    """{key: value} of every key `--set` takes for `name`, read off `config` (the built algorithm,
    its config dataclass, or that config as a dict, e.g. config.json's `algorithm_config`;
    defaults included; the optimiser's parts flat), as YAML/JSON-safe values: passing them all
    back to the factory builds the same config (tests/test_runconfig.py)."""
    from fedheads.core.optim import _OPT_KEYS

    if hasattr(config, "cfg") and not dataclasses.is_dataclass(config):
        config = config.cfg
    cfg = _plain(config) or {}
    out: dict[str, Any] = {}
    for s in settings_of(name)[0]:
        out[s.key] = cfg[s.key] if s.key in cfg else cfg[OPT_FIELD][_OPT_KEYS[s.key]]
    return out


# ------------------------------------------------------------------ settings of a command (finetune, feddra)


@dataclass(frozen=True)
class Part:
    """Fields of one config dataclass that a command takes as flat `--set` keys."""

    cls: type
    keys: tuple[str, ...] | None = None  # None: every field (except those holding a dataclass)
    exclude: tuple[str, ...] = ()  # fields the command sets from its own options (feddra's rounds)

    def fields(self) -> list[dataclasses.Field]:
        out = []
        for f in dataclasses.fields(self.cls):
            if f.name in self.exclude or (self.keys is not None and f.name not in self.keys):
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
            if self.keys is None and dataclasses.is_dataclass(default):
                continue  # a nested config: its own Part lists its fields
            out.append(f)
        return out


def command_settings(parts: Iterable[Part]) -> list[Setting]:
    """Every key of a command's settings with type, default, doc and source (field metadata)."""
    out = []
    for part in parts:
        base = _defaults(part.cls)
        for f in part.fields():
            doc, source = setting_doc(f)
            out.append(Setting(f.name, str(f.type), getattr(base, f.name), doc, source))
    return sorted(out, key=lambda s: s.key)


def _checked(key: str, type_: str, value: Any) -> Any:
    """`value` as the field's annotation wants it (an int where a float is declared becomes a float,
    a number where text is declared becomes text), or one line naming the key."""
    import math

    opts = [t.strip() for t in type_.split("|")]
    shown = value if isinstance(value, str) else json.dumps(value)
    if value is None:
        if "None" in opts:
            return None
    elif "bool" in opts:
        if isinstance(value, bool):
            return value
    elif isinstance(value, bool):
        pass
    elif "int" in opts and isinstance(value, int):
        return value
    elif "float" in opts and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None:
            if not math.isfinite(number):
                raise UserError(f"--set {key}={shown}: must be a finite number")
            return number
    elif "str" in opts and isinstance(value, (str, int, float)):
        return str(value)
    elif any(o.startswith("tuple") for o in opts) and isinstance(value, (list, tuple)):
        return tuple(value)
    elif not {"bool", "int", "float", "str"} & set(opts) and not any(o.startswith("tuple") for o in opts):
        return value  # a type this check does not know: the config's own checks decide
    raise UserError(f"--set {key}={shown}: expected {type_}")


def split_settings(command: str, parts: tuple[Part, ...], items: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    """`--set` items (later ones win) -> one {field: value} per part, each value checked against
    its field's type; a key of no part is one line naming it and the valid keys."""
    owner = {f.name: (i, f) for i, part in enumerate(parts) for f in part.fields()}
    out: list[dict[str, Any]] = [{} for _ in parts]
    for key, value in items:
        if key not in owner:
            import difflib

            near = difflib.get_close_matches(key, list(owner), n=1)
            hint = f"did you mean {near[0]}? " if near else ""
            raise UserError(f"--set {key}: not a setting of `fedheads {command}` ({hint}valid keys: "
                            f"{', '.join(sorted(owner))})")
        i, f = owner[key]
        out[i][key] = _checked(key, str(f.type), value)
    return out


def settings_values(parts: tuple[Part, ...], configs: Iterable[Any]) -> dict[str, Any]:
    """{key: value} of every setting, read off the configs a command built (one per part), as
    YAML/JSON-safe values: passing them back as --set builds the same configs."""
    out: dict[str, Any] = {}
    for part, cfg in zip(parts, configs):
        for f in part.fields():
            out[f.name] = _plain(getattr(cfg, f.name))
    return dict(sorted(out.items()))


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


def settings_for(name: str, settings: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(scoped, unscoped) --set fields for algorithm `name`: `name.key=v` applies to `name` only
    and must be one of its fields; a plain `key=v` applies to every algorithm it fits."""
    scoped: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for key, value in settings:
        scope, dot, field_ = key.rpartition(".")
        if not dot:
            plain[key] = value
        elif scope == name:
            scoped[field_] = value
    return scoped, plain


def resolve_settings(name: str, opts: Any, strict: bool = True) -> tuple[dict[str, Any], list[str]]:
    """(the config fields a run of `name` is built with, the options that do not apply to it),
    decided from the fields of its config dataclass (fedheads.run.options), nothing built.

    A field scoped to this algorithm (`--set lp.lr=0.1`) must be one of its settings. A plain
    --set key or a generic option (--lr, --batch-size, --local-epochs) that is not: with
    `strict` an error naming it (`train`); else dropped and returned (`compare`)."""
    keys = set(valid_keys(name))
    scoped, plain = settings_for(name, opts.settings)
    bad = next((k for k in scoped if k not in keys), None)
    if bad is not None:
        raise unknown_key_error(bad, [name], f"--set {name}.{bad}")
    used, ignored = dict(scoped), []
    generic = opts.generic()
    for k, v in {**plain, **generic}.items():
        if k in used:
            continue  # the scoped value wins
        if k in keys:
            used[k] = v
        elif not strict:
            ignored.append(k)
        elif k in generic:
            raise UserError(f"--{k.replace('_', '-')}: does not apply to algorithm {name}")
        else:
            raise unknown_key_error(k, [name])
    return used, ignored


_TAKES: dict[str, tuple[str, Callable[[Any], bool]]] = {  # annotation -> (what it takes, in words; check)
    "None": ("null", lambda v: v is None),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),  # finite: check_finite
    "str": ("text", lambda v: isinstance(v, str)),
}  # not containers: a factory may take other spellings of them (mlp's hidden=512 or "512,256")


def check_setting_type(name: str, key: str, annotation: str, value: Any) -> None:
    """One line naming the key, the value and what the config field's annotation takes, where
    `value` is not of that type (an annotation this check does not know: the config decides)."""
    opts = [t.strip() for t in annotation.split("|")]
    if any(o not in _TAKES for o in opts) or any(_TAKES[o][1](value) for o in opts):
        return
    shown = value if isinstance(value, str) else json.dumps(value)
    raise UserError(f"--set {key}={shown}: {name}'s {key} takes {' or '.join(_TAKES[o][0] for o in opts)}")


def build_algorithm(name: str, opts: Any, strict: bool = True) -> tuple[Any, dict[str, Any], list[str]]:
    """The algorithm, built once with every --set field and generic option that applies to it
    (resolve_settings). Returns (algorithm, the kwargs used, options that do not apply). A value
    not of its field's type is one line saying what the field takes (check_setting_type), before
    anything is built; a value its config refuses is one line naming the algorithm and the settings."""
    used, ignored = resolve_settings(name, opts, strict)
    types = {s.key: s.type for s in settings_of(name)[0]}
    for k, v in used.items():
        check_setting_type(name, k, types[k], v)
    from fedheads.algorithms import create_algorithm

    try:
        alg = create_algorithm(name, **used)
    except (TypeError, ValueError) as e:  # a value of the wrong type reaching the config's checks
        given = ", ".join(f"{k}={v!r}" for k, v in used.items())
        raise UserError(f"--set for {name}: not valid values ({given}): {e}") from None
    if opts.dp is not None:  # refuses an algorithm without a DP form in one line
        from fedheads.privacy import Private

        alg = Private(alg, opts.dp)
    return alg, used, ignored
