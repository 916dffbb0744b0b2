"""The settings of a method (`--set KEY=VALUE`; `settings=` in the Python API), read off its
declared config dataclass: an algorithm's (`register_algorithm(..., config=...)`) for `train`,
`compare` and Flower runs, the fine-tuning or FedDRA configs for `finetune` and `feddra`. Every
field with its type, default, and the one-line doc and paper source that
fedheads.core.config.setting records in the field's metadata. `fedheads algorithms NAME` (and
`--list-settings`) print them; `--set`, `--config` and `--dump-config` check and write the same
keys; an unknown key's error lists them.

The client optimiser is one nested field (`optimizer`); the registry takes its parts as flat keys
(`lr`, `weight_decay`, `momentum`, `optimizer_name`: fedheads.core.optim.config_from_kwargs), so
they are listed flat, with the algorithm's own optimiser defaults. Fields the registration fixes
(lp's `hidden`) are not keys.

The algorithm of a run is built here, once, from those settings (build_algorithm)."""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedcache.errors import UserError
from embedcache.parsing import loads_json
from fedheads.core.config import setting_doc

OPT_FIELD = "optimizer"


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


def plain(v: Any) -> Any:
    """A value as YAML / JSON writes it (tuples as lists, dataclasses as mappings)."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


def resolved_settings(name: str, config: Any) -> dict[str, Any]:
    """{key: value} of every key `--set` takes for `name`, read off `config` (the built algorithm,
    its config dataclass, or that config as a dict, e.g. config.json's `algorithm_config`;
    defaults included; the optimiser's parts flat), as YAML/JSON-safe values: passing them all
    back to the factory builds the same config (tests/test_runconfig.py)."""
    from fedheads.core.optim import _OPT_KEYS

    if hasattr(config, "cfg") and not dataclasses.is_dataclass(config):
        config = config.cfg
    cfg = plain(config) or {}
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
            out[f.name] = plain(getattr(cfg, f.name))
    return dict(sorted(out.items()))


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
        import dataclasses

        from fedheads.privacy import Private

        mech, seeds = opts.dp, len(getattr(opts, "seeds", ()) or (0,))
        if mech.epsilon is not None and seeds > 1:  # the seeds' heads release the same data: the budget covers all
            mech = dataclasses.replace(mech, releases=mech.releases * seeds)
        alg = Private(alg, mech)
    return alg, used, ignored


def describe(name: str | None, show: bool = False, as_json: bool = False) -> str:
    """What `fedheads algorithms [NAME] [--show] [--json]` prints: the names and descriptions (read
    off the sources when they state them: no torch), or every setting of NAME (of all with `show`)."""
    import sys

    from fedheads.algorithm_names import declared
    from fedheads.run.checks import check_algorithms

    if name is not None:
        check_algorithms([name])  # a typo: one line at once, with the nearest name
    if name is None and not show:
        rows = [(d.name, d.description) for d in declared()]
        if "fedheads.algorithms" in sys.modules or any(desc is None for _, desc in rows):  # a plugin's: registered
            from fedheads.algorithms import list_algorithms

            rows = [(i.name, i.description) for i in list_algorithms()]
        if as_json:
            return json.dumps([{"name": n, "description": d} for n, d in sorted(rows)], indent=2)
        return "\n".join(f"{n:16s} {d}" for n, d in sorted(rows))
    return _remembered((name, show, as_json), lambda: _settings_text(name, as_json))


def _settings_text(name: str | None, as_json: bool) -> str:
    from fedheads.algorithms import list_algorithms

    names = [name] if name is not None else [i.name for i in list_algorithms()]
    if as_json:
        out = [settings_json(n) for n in names]
        return json.dumps(out[0] if name is not None else out, indent=2, default=str)
    return "\n\n".join(settings_table(n) for n in names)


def _source_key() -> str | None:
    """sha256 of every source file of the fedheads package and the embedcache modules it reads,
    in path order: what the settings text is a function of. None where it is not knowable without
    importing: an algorithm installed by another package, or plugins already registered."""
    import hashlib
    import sys

    from fedheads.algorithm_names import installed

    if installed() or "fedheads.algorithms" in sys.modules:
        return None
    h = hashlib.sha256()
    for pkg in ("fedheads", "embedcache"):
        root = Path(__file__).resolve().parents[2] / pkg
        for f in sorted(root.rglob("*.py")):
            h.update(f.relative_to(root.parent).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def settings_cache_dir() -> Path:
    """``$FEDHEADS_CACHE`` or ``~/.cache/fedheads``."""
    import os

    env = os.environ.get("FEDHEADS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedheads"


def _remembered(request: tuple, compute: Callable[[], str]) -> str:
    """The settings text of `request`, computed once per version of the sources: it needs every
    algorithm's module, hence torch (about 2 s), while the text depends only on the source files.
    It is kept under settings_cache_dir(), keyed by the sha256 of those files, so it is never stale;
    an unwritable cache only costs the import next time."""
    from embedcache.atomic import write_text

    key = _source_key()
    if key is None:
        return compute()
    path = settings_cache_dir() / "settings" / f"{key[:32]}.json"
    slot = json.dumps(request)
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(known, dict) and isinstance(known.get(slot), str):
            return known[slot]
    except (OSError, ValueError):
        known = {}
    text = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps({**(known if isinstance(known, dict) else {}), slot: text}))
        for old in sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime)[:-8]:
            old.unlink()  # the texts of older sources: the newest eight kept (checkouts side by side)
    except OSError:
        pass
    return text
