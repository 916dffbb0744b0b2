"""Every command's options, declared once (fedheads.run.commands: one frozen dataclass per command,
each field declared with fedheads.core.config.setting). From it, and from nothing else, come the
command's click options and their --help (`command_options`), `--config FILE` / `--dump-config`
(`read_config`, `file_config`: keys are the long option names), the Python API's keyword checks
(`from_keywords`), every value checked by one function (`coerce`) with one-line refusals, and
the generated documentation (docs/cli.md, docs/api.md). A field holding an options object
(`nested=`) contributes its fields: as the command's own (`inline`) or under a prefix (`--dp-*`:
the privacy mechanism, built when any of them is given).

Merge order: built-in defaults < the config file < command-line flags (incl. --set): the file's
values become click's `default_map`, and its `set:` is merged key by key with --set. No torch:
`fedheads --help` and the refusal of a bad option do not wait for it."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from embedcache.errors import UserError
from fedheads.run.settings import parse_settings, plain


# ------------------------------------------------------------------ reading the declarations
@dataclass(frozen=True)
class Opt:
    """One option of a command: a field of its options dataclass or of a nested one."""

    key: str  # file key, API keyword and click parameter name (a prefixed field: dp_epsilon)
    path: tuple[str, ...]  # field names from the command's dataclass down to this field
    field: dataclasses.Field

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.field.metadata

    @property
    def flag(self) -> str:
        return "--" + str(self.meta.get("name") or self.key).replace("_", "-")

    @property
    def file_key(self) -> str:
        """Its key in a config file: the long option name, `_` for `-` (--head: head)."""
        return self.flag[2:].replace("-", "_")

    @property
    def kind(self) -> str:
        """bool | int | float | str | ints | strs (comma lists) | pairs (K=V,...) | set (repeatable KEY=VALUE,
        as pairs, or as their JSON where the field is text) | repeat (a repeatable text)."""
        t = str(self.field.type).replace(" ", "").replace("|None", "")
        if self.meta.get("multiple"):
            return "repeat" if t == "tuple[str,...]" else "set"
        return {"tuple[int,...]": "ints", "tuple[str,...]": "strs", "tuple[tuple[str,float],...]": "pairs"}.get(t, t)

    @property
    def default(self) -> Any:
        f = self.field
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]

    @property
    def doc(self) -> str:
        src = self.meta.get("source")
        return str(self.meta.get("doc", "")) + (f" [{src}]" if src else "")


def _nested(f: dataclasses.Field) -> type | None:
    """The options class of a nested field (None: an option itself)."""
    cls = f.metadata.get("nested")
    if cls == "dp":  # the privacy mechanism (fedheads.privacy_accounting: no torch)
        from fedheads.privacy_accounting import Mechanism

        return Mechanism
    return cls


def walk(cls: type, prefix: str = "", path: tuple[str, ...] = (), skip: Iterable[str] = ()) -> Iterator[Opt]:
    """Every option of `cls`, nested objects' fields in their place (an inline field's `skip`:
    fields of the nested object that are not this command's)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        sub = _nested(f)
        if sub is not None:
            pre = f"{f.metadata['prefix']}_" if f.metadata.get("prefix") else ""
            yield from walk(sub, prefix + pre, (*path, f.name), f.metadata.get("skip", ()))
        else:
            yield Opt(prefix + f.name, (*path, f.name), f)


def options_of(cls: type) -> dict[str, Opt]:
    return {o.key: o for o in walk(cls)}


def _text(o: Opt, v: Any) -> Any:
    """A value as the command line spells it (a list as comma text)."""
    if o.kind in ("ints", "strs"):
        return None if v is None else ",".join(map(str, v))
    if o.kind == "pairs":
        return ",".join(f"{k}={w:g}" for k, w in v or ()) or None
    return v


class DeclaredCommand(click.Command):
    """A command of generated options: a misspelt or retired option is one line naming the option
    and its nearest (or its replacement), as the API refuses a misspelt keyword."""

    def __init__(self, *args: Any, declared: type, retired: Callable[[], dict[str, str]] | None = None,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.declared, self.retired_of = declared, retired

    @property
    def retired(self) -> dict[str, str]:
        return self.retired_of() if self.retired_of else {}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            key = exc.option_name.lstrip("-").replace("-", "_")
            if key in self.retired:
                raise UserError(f"{exc.option_name}: {self.retired[key]}") from None
            longs = [o[2:] for p in self.params for o in p.opts if o.startswith("--")]
            raise no_such(f"fedheads {self.name}", exc.option_name, [x.replace("-", "_") for x in longs]) from None


def command_options(cls: type, skip: Iterable[str] = ()) -> Callable[[Callable], Callable]:
    """Decorator: the click options of `cls` (fields declared with `cli=False` and `skip` left out)."""
    def deco(f: Callable) -> Callable:
        for o in reversed([o for o in walk(cls) if o.meta.get("cli", True) and o.key not in set(skip)]):
            kw: dict[str, Any] = {"help": o.doc, "required": bool(o.meta.get("required"))}
            if o.kind == "bool" and o.meta.get("negate"):  # --quiet: progress False
                decls, kw = [o.flag, o.key], {**kw, "is_flag": True, "flag_value": False, "default": True,
                                              "help": f"no {o.doc}"}
            elif o.kind == "bool":
                decls = [f"{o.flag}/--no-{o.flag[2:]}" if o.default else o.flag, o.key]
                kw.update(is_flag=True, default=o.default)
            else:
                decls = [o.flag, o.key]
                typ = {"int": click.INT, "float": click.FLOAT}.get(o.kind, click.STRING)
                if o.meta.get("choices"):
                    typ = click.Choice(list(o.meta["choices"]))
                default = None if kw["required"] or o.kind in ("set", "repeat") else _text(o, o.default)
                kw.update(type=typ, default=default, show_default=default not in (None, ""),
                          multiple=o.kind in ("set", "repeat"), metavar=o.meta.get("metavar"))
            if o.meta.get("short"):
                decls.insert(1, o.meta["short"])
            f = click.option(*decls, **kw)(f)
        return f

    return deco


# ------------------------------------------------------------------ values: flags, files and keywords
def coerce(o: Opt, v: Any, where: str = "") -> Any:
    """`v` (from click, a config file or a keyword) as the field holds it, or one line naming the
    option and what it takes."""
    shown = f"{where}{o.key}={v!r}" if where else f"{o.flag} {v!r}"  # the API's keyword, or the flag
    if v is None or (o.kind == "bool" and isinstance(v, bool)):
        return v
    if o.kind in ("ints", "strs"):
        items = [x.strip() for x in v.split(",")] if isinstance(v, str) else (list(v) if isinstance(v, (list, tuple))
                                                                               else [v])
        items = [x for x in items if x != ""]
        try:
            return tuple(int(x) for x in items if not isinstance(x, bool)) if o.kind == "ints" else tuple(
                str(x) for x in items)
        except (TypeError, ValueError):
            raise UserError(f"{shown}: expected comma-separated integers") from None
    if o.kind == "pairs":
        if isinstance(v, Mapping):
            v = list(v.items())
        if isinstance(v, str):
            v = [tuple(x.split("=", 1)) for x in v.split(",") if x.strip()]
        try:
            return tuple((str(k).strip(), float(w)) for k, w in v)
        except (TypeError, ValueError):
            raise UserError(f"{shown}: expected FIELD=WEIGHT,..., e.g. sums=0.9,counts=0.1") from None
    if o.kind == "set":
        if isinstance(v, str) and str(o.field.type) == "str":
            return v  # already the JSON a text field holds
        pairs = tuple((str(k).replace("-", "_"), x) for k, x in v.items()) if isinstance(v, Mapping) else \
            tuple(p for x in v for p in (parse_settings([x]) if isinstance(x, str) else [tuple(x)]))
        return json.dumps([list(p) for p in pairs]) if str(o.field.type) == "str" else pairs
    if o.kind == "repeat":
        return (v,) if isinstance(v, str) else tuple(str(x) for x in v)
    if o.kind == "int" and isinstance(v, int) and not isinstance(v, bool):
        return v
    if o.kind == "float" and isinstance(v, (int, float)) and not isinstance(v, bool):
        if not math.isfinite(v):
            raise UserError((f"{where}{o.key}={v}" if where else f"{o.flag} {v}") + ": must be a finite number")
        return float(v)
    if o.kind == "str" and isinstance(v, (str, os.PathLike)):
        v = os.fspath(v)
        if o.meta.get("choices") and v not in o.meta["choices"]:
            raise UserError(f"{shown}: expected one of {' | '.join(o.meta['choices'])}")
        return v
    if o.kind not in ("bool", "int", "float", "str"):
        return v  # a type this module does not know: the dataclass's own checks decide
    takes = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "text"}[o.kind]
    raise UserError(f"{shown}: expected {takes}")


def build(cls: type, values: Mapping[str, Any], where: str = "", prefix: str = "") -> Any:
    """`cls` from {option key: value} (missing keys: the declared defaults). A nested object under a
    prefix whose default is None (the privacy mechanism) is built when any of its options is given."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        sub = _nested(f)
        if sub is None:
            if prefix + f.name in values:
                kw[f.name] = coerce(Opt(prefix + f.name, (f.name,), f), values[prefix + f.name], where)
            continue
        pre = prefix + (f"{f.metadata['prefix']}_" if f.metadata.get("prefix") else "")
        if pre != prefix and f.default is None:
            own = options_of(sub)
            given = {k: v for k, v in values.items() if k.startswith(pre) and k[len(pre):] in own
                     and v is not None and v != own[k[len(pre):]].default}
            kw[f.name] = build(sub, given, where, pre) if given else None
        else:
            kw[f.name] = build(sub, values, where, pre)
    return cls(**kw)


def retired_lines(cls: type, how: str) -> dict[str, str]:
    """{option: the line refusing it} of the options a command does not take (`cls.retired`: {option:
    (--set key, the value a flag stood for or None), for one that became a method setting, or the line
    itself}); `how`: "--set " or "settings=" (the API)."""
    def line(key: str, v: Any) -> str:
        value = "VALUE" if v is None else json.dumps(v)
        new = f"--set {key}={value}" if how == "--set " else f"settings={{{key!r}: {value}}}"
        return f"replaced by {new} (the option was removed)"

    return {k: r if isinstance(r, str) else line(*r) for k, r in getattr(cls, "retired", {}).items()}


def no_such(what: str, name: str, known: Iterable[str], flag: bool = True) -> UserError:
    """The one line of a misspelt option or keyword (the command line and the API alike)."""
    spell = (lambda k: "--" + k.replace("_", "-")) if flag else (lambda k: k)
    near = difflib.get_close_matches(name.lstrip("-").replace("-", "_"), list(known), n=1)
    hint = f"; did you mean {spell(near[0])}?" if near else ""
    return UserError(f"{what}: no option {name}{hint}")


def from_keywords(cls: type, kw: Mapping[str, Any], what: str, **fixed: Any) -> Any:
    """`cls` from the Python API's keywords (the option keys), each checked as the command line
    checks its flag; `fixed`: values the function's own arguments give."""
    opts, retired = options_of(cls), retired_lines(cls, "settings=")
    values: dict[str, Any] = {}
    for k, v in kw.items():
        nested = _prefixed(cls).get(k)
        if nested is not None and k not in opts:  # dp=Mechanism(...) or dp={"epsilon": 1.0}: its options
            fields = v.__dict__ if dataclasses.is_dataclass(v) else dict(v or {})
            own = [f.name for f in dataclasses.fields(nested)]
            bad = next((name for name in fields if name not in own), None)
            if bad is not None:
                raise UserError(f"{what}: {k}: unknown field {bad!r} (fields: {', '.join(own)})")
            values.update({f"{k}_{name}": x for name, x in fields.items()})
        elif k in retired:
            raise UserError(f"{what}: {k}: {retired[k]}")
        elif k not in opts or k in fixed:
            raise no_such(what, k, [o for o in opts if o not in fixed], flag=False)
        else:
            values[k] = v
    return build(cls, {**values, **fixed}, f"{what}: ")


def _prefixed(cls: type) -> dict[str, type]:
    """{prefix: options class} of the nested objects `cls` holds under a prefix (dp: the mechanism)."""
    out: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        sub = _nested(f)
        if sub is not None:
            out.update({f.metadata["prefix"]: sub} if f.metadata.get("prefix") else _prefixed(sub))
    return out


def from_context(cls: type, ctx: click.Context, **fixed: Any) -> Any:
    """`cls` from a click command's parameters (and the --config file's `set:` merged into --set)."""
    values = {k: v for k, v in ctx.params.items() if k in options_of(cls)}
    for o in walk(cls):
        if o.kind == "set" and o.key in values:
            values[o.key] = merged_settings(ctx, parse_settings(values[o.key] or ()))
    return build(cls, {**values, **fixed})


# ------------------------------------------------------------------ config files
META = "fedheads.config_settings"  # ctx.meta key: the file's `set:` entries
HEADER = ("# fedheads {command}: the effective configuration (fedheads {command} --config FILE runs it again).\n"
          "# Merge order: built-in defaults < this file < command-line flags.\n")


def read_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--config's callback (eager: it runs before the other options are read): each key checked as
    its flag's value is (`coerce`), or one line naming it; the values become click's defaults."""
    if value is None:
        return None
    doc, cmd = _load_file(value), ctx.command
    opts = {o.file_key: o for o in walk(cmd.declared) if o.meta.get("cli", True) and not o.meta.get("operational")}  # type: ignore[attr-defined]
    dm: dict[str, Any] = {}
    for raw, v in doc.items():
        key = str(raw).replace("-", "_")
        if key == "command":
            if v != cmd.name:
                raise UserError(f"{value}: written for `fedheads {v}`, not `fedheads {cmd.name}`")
        elif key == "set" and "set" in opts:
            if not isinstance(v, dict):
                raise UserError(f"{value}: set: expected a mapping of the method's settings, got {v!r}")
            ctx.meta[META] = [(str(k).replace("-", "_"), x) for k, x in v.items()]
        elif key in opts and key != "set":
            dm[opts[key].key] = None if v is None else _text(opts[key], coerce(opts[key], v, f"{value}: "))
        elif key in getattr(cmd, "retired", {}):
            raise UserError(f"{value}: {key}: {cmd.retired[key]}")  # type: ignore[attr-defined]
        else:
            raise UserError(f"{value}: unknown key {raw!r} for `fedheads {cmd.name}` (valid keys: command, "
                            f"{', '.join(sorted(opts))})")
    ctx.default_map = {**(ctx.default_map or {}), **dm}
    return value


def _load_file(value: str) -> dict[str, Any]:
    import yaml

    from embedcache.parsing import loads_json, loads_yaml

    try:
        text = Path(value).read_text()
        doc = loads_json(text, f"--config {value}") if value.lower().endswith(".json") else \
            loads_yaml(text, f"--config {value}")
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
    return doc


def config_options(f: Callable) -> Callable:
    """Add --config and --dump-config to a command (the command receives `dump_config`)."""
    f = click.option("--dump-config", is_flag=True,
                     help="Print the effective configuration as YAML (every option, and under set: every "
                          "setting of the method with its value) and exit.")(f)
    return click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
                        callback=read_config,
                        help="YAML or JSON file of options (keys: the long option names, and set: for the "
                             "method's settings). Merge order: defaults < config file < command-line flags (incl. "
                             "--set).")(f)


def merged_settings(ctx: click.Context, cli: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """The file's `set:` entries, minus those the command line replaces (a --set of the same key,
    plain or scoped, or a --lr / --batch-size / --local-epochs flag), then the command line's."""
    given = {k for k, _ in cli}
    for name in ("lr", "batch_size", "local_epochs"):
        if name in ctx.params and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            given.add(name)
    plain = {k for k in given if "." not in k}
    kept = [(k, v) for k, v in ctx.meta.get(META, []) if k not in given and k.rpartition(".")[2] not in plain]
    return tuple(kept) + tuple(cli)


def file_config(obj: Any) -> dict[str, Any]:
    """An options object as its config file holds it: every option that is not operational (a
    nested mechanism that is None: its options at their defaults, as `--dump-config` has always
    written them), comma lists as lists, keyed like the file (the command adds `set:` itself)."""
    out: dict[str, Any] = {}
    for o in walk(type(obj)):
        if o.meta.get("operational") or not o.meta.get("cli", True) or o.kind == "set":
            continue
        value: Any = obj
        for name in o.path:
            value = o.default if value is None else getattr(value, name)
        out[o.file_key] = _text(o, value) if o.kind == "pairs" else plain(value)
    return out


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
