"""Reading hand-editable JSON and YAML (manifests, run configs, export indexes) strictly: a key
given twice in one mapping is refused in one line naming the key and the file. Both parsers
would otherwise keep the last value silently, so a hand edit that pastes a second `classes:` or
`clients:` swaps the class list or loses samples without a word."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embedcache.errors import UserError


class _DuplicateKey(ValueError):
    def __init__(self, key: Any, line: int | None = None) -> None:
        super().__init__(key)
        self.key, self.line = key, line

    def describe(self, where: str) -> str:
        at = f" (line {self.line})" if self.line is not None else ""
        return f"{where}: key {self.key!r} appears twice in one mapping{at}; keep one"


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def loads_json(text: str, where: str) -> Any:
    """json.loads refusing duplicate keys (UserError naming `where`); other syntax errors are
    the caller's to report (json.JSONDecodeError, a ValueError)."""
    try:
        return json.loads(text, object_pairs_hook=_pairs)
    except _DuplicateKey as exc:
        raise UserError(exc.describe(where)) from None


def _yaml_loader() -> type:
    import yaml

    class StrictSafeLoader(yaml.SafeLoader):
        """yaml.SafeLoader that refuses a mapping key given twice (merge keys `<<` excepted:
        overriding merged keys is what they are for)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            if isinstance(node, yaml.MappingNode):
                seen: set = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        dup = key in seen
                    except TypeError:
                        continue  # unhashable: SafeLoader reports it
                    if dup:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictSafeLoader


def loads_yaml(text: str, where: str) -> Any:
    """yaml.safe_load refusing duplicate keys (UserError naming `where` and the line); other
    syntax errors are the caller's to report (yaml.YAMLError)."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as exc:
        raise UserError(exc.describe(where)) from None


def read_json(path: str | Path, what: str = "") -> Any:
    """A JSON file, strictly: UserError (one line naming the file) when it cannot be read, is not
    valid JSON or holds a key twice."""
    path = Path(path)
    label = f"{what} {path}".strip()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{label}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return loads_json(text, label)
    except ValueError as exc:
        raise UserError(f"{label}: not valid JSON ({str(exc).splitlines()[0]})") from None
