"""What `--set KEY=VALUE` (and `settings=` in the Python API) can change, read off the
algorithms' config dataclasses: every field with its type, default, one-line doc (the comment on
its line) and, where the comment or the class docstring cites the paper (Sec., Table, App., Eq.,
Alg.), that source. `fedheads algorithms NAME` prints it; an unknown key's error lists the keys.

The client optimiser is one nested field (`optimizer`); the registry takes its parts as flat keys
(`lr`, `weight_decay`, `momentum`, `optimizer_name`: fedheads.core.optim.config_from_kwargs), so
they are listed flat, with the algorithm's own optimiser defaults."""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import re
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from embedcache.errors import UserError
from embedcache.parsing import loads_json

OPT_FIELD = "optimizer"
_CITE = re.compile(r"\b(?:Sec(?:tion)?\.?|Tables?|App(?:endix|\.)|Eq(?:s|uation)?\.?|Alg(?:orithm|\.)|Fig(?:ure|\.)?)"
                   r"\s*(?:[A-Z]?\.?\d[\w.\-]*|[A-Z]\b)(?:\s*(?:/|,|and)\s*(?:[A-Z]?\.?\d[\w.\-]*|[A-Z]\b))*")


@dataclass(frozen=True)
class Setting:
    """One settable key of an algorithm."""

    key: str  # what --set takes
    type: str  # the field's annotation
    default: Any  # the algorithm's default value
    doc: str  # the comment on the field's line (continuation comment lines joined)
    source: str  # the paper passage(s) the comment cites for it ("" when none)


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


def field_comments(cls: type) -> dict[str, str]:
    """{field: its trailing comment, with comment-only lines right below it appended}."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):  # defined in a notebook or exec'd code: no source to read
        return {}
    toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    fields: dict[int, str] = {}  # row -> field name, for rows that start with `name:`
    for a, b in zip(toks, toks[1:]):
        if (a.type == tokenize.NAME and b.type == tokenize.OP and b.string == ":"
                and a.line[: a.start[1]].strip() == "" and a.start[0] not in fields):
            fields[a.start[0]] = a.string
    out: dict[str, str] = {}
    current, last_row = None, -1
    for t in toks:
        if t.type != tokenize.COMMENT:
            continue
        row, text = t.start[0], t.string.lstrip("#").strip()
        if row in fields:
            current, last_row = fields[row], row
            out[current] = text
        elif current is not None and row == last_row + 1 and t.line.strip().startswith("#"):
            out[current] += " " + text  # a comment-only line continuing the field's comment
            last_row = row
        else:
            current = None
    return out


def _cites(text: str) -> str:
    return "; ".join(m.group(0).strip().rstrip(".,;") for m in _CITE.finditer(text))


def _config_of(name: str) -> Any:
    from fedheads.algorithms import create_algorithm

    cfg = getattr(create_algorithm(name), "cfg", None)
    return cfg if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) else None


def settings_of(name: str) -> tuple[list[Setting], str]:
    """(every key `--set` takes for algorithm `name`, the config class docstring). UserError for
    an unknown algorithm; an algorithm without a config dataclass has no keys."""
    from fedheads.core.config import setting_doc  # here: this module is read before torch loads

    cfg = _config_of(name)
    if cfg is None:
        return [], ""
    cls = type(cfg)
    notes = field_comments(cls)
    doc = inspect.cleandoc(cls.__doc__ or "")
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        value = getattr(cfg, f.name)
        comment = notes.get(f.name, "")
        if f.name == OPT_FIELD and dataclasses.is_dataclass(value):
            why = comment or "; ".join(p for p in setting_doc(f) if p)
            out += _optimizer_settings(value, why, {g.name for g in dataclasses.fields(cls)})
            continue
        if not comment:  # declared with fedheads.core.config.setting: its doc and source travel with the field
            doc_, source = setting_doc(f)
            out.append(Setting(f.name, str(f.type), value, doc_, source))
            continue
        out.append(Setting(f.name, str(f.type), value, comment, _cites(comment)))
    return sorted((s for s in out if _accepted(name, s)), key=lambda s: s.key), doc


def _accepted(name: str, s: Setting) -> bool:
    """Whether the algorithm's factory takes the key (lp's config has `hidden`, its factory
    refuses it: mlp is the one with hidden layers)."""
    from fedheads.algorithms import create_algorithm

    try:
        create_algorithm(name, **{s.key: s.default})
    except TypeError:
        return False
    return True


_OPT_DOCS = {"lr": "client learning rate", "weight_decay": "client L2 weight decay (added to the gradient)",
             "momentum": "client SGD momentum", "optimizer_name": "client optimiser: adam | sgd"}


def _optimizer_settings(opt: Any, comment: str, own: set[str]) -> list[Setting]:
    """The flat keys of the nested optimiser field; the algorithm's comment on that field says
    where its optimiser defaults come from."""
    from fedheads.core.optim import _OPT_KEYS

    types = {f.name: str(f.type) for f in dataclasses.fields(opt)}
    out = []
    for key, part in _OPT_KEYS.items():
        if key in own:  # the config's own field wins (pFedMe's `lr`)
            continue
        doc = _OPT_DOCS.get(key, key) + (f" (optimiser: {comment})" if comment else "")
        out.append(Setting(key, types[part], getattr(opt, part), doc, _cites(comment)))
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
    w = [max(len(c) for c in col) for col in zip(*[("key", "type", "default")] +
                                                     [(r.key, r.type, _fmt(r.default)) for r in rows])]
    lines = ["", f"{'key':{w[0]}}  {'type':{w[1]}}  {'default':{w[2]}}  doc [source]"]
    for r in rows:
        src = f" [{r.source}]" if r.source else ""
        lines.append(f"{r.key:{w[0]}}  {r.type:{w[1]}}  {_fmt(r.default):{w[2]}}  {r.doc}{src}")
    generic = [f"--{k.replace('_', '-')}" for k in ("lr", "batch_size", "local_epochs") if k in {r.key for r in rows}]
    also = f"; {'/'.join(generic)} set the key{'s' if len(generic) > 1 else ''} of that name" if generic else ""
    return "\n".join(head + lines + ["", f"set with --set KEY=VALUE (or --set {name}.KEY=VALUE in compare){also}"])


def settings_json(name: str) -> dict[str, Any]:
    rows, doc = settings_of(name)
    return {"name": name, "doc": doc,
            "settings": [{"key": r.key, "type": r.type, "default": r.default if not dataclasses.is_dataclass(r.default)
                          else dataclasses.asdict(r.default), "doc": r.doc, "source": r.source} for r in rows]}


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def resolved_settings(name: str, algorithm: Any) -> dict[str, Any]:
    """{key: value} of every key `--set` takes for `name`, read off the built `algorithm`'s config
    (defaults included; the optimiser's parts flat), as YAML/JSON-safe values: passing them all
    back to the factory builds the same config (tests/test_runconfig.py)."""
    from fedheads.core.optim import _OPT_KEYS

    cfg = getattr(algorithm, "cfg", None)
    out: dict[str, Any] = {}
    for s in settings_of(name)[0]:
        if hasattr(cfg, s.key):
            v = getattr(cfg, s.key)
        else:  # a flat key of the nested optimiser field
            v = getattr(getattr(cfg, OPT_FIELD), _OPT_KEYS[s.key])
        out[s.key] = _plain(v)
    return out
