"""The algorithm names, known without importing torch: a file dropped into `fedheads/algorithms/`
is an algorithm as soon as it calls ``register_algorithm("NAME", ...)`` at module level (the
name a string literal), and a package installed with an entry point in the group
``fedheads.algorithms`` (``NAME = "module"``) adds one. Both are read here without importing
them (the sources' syntax trees, the installed packages' metadata), so `fedheads algorithms` lists
them and a typo is refused at once; the registry (fedheads.algorithms) imports exactly those
modules. `--plugin MODULE` registers more once imported."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "fedheads.algorithms"
GROUP = "fedheads.algorithms"  # the entry point group of third-party algorithms
_DIR = Path(__file__).resolve().parent / "algorithms"


@dataclass(frozen=True)
class Declared:
    name: str
    module: str  # what registers it
    description: str | None  # its one line, when the source states it literally


def _description(call: ast.Call, classes: dict[str, ast.ClassDef]) -> str | None:
    """The `description=` of a register call: a literal, or `Cls.description` of a class in the
    same file whose body assigns it a literal."""
    arg = next((k.value for k in call.keywords if k.arg == "description"), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id in classes:
        for node in classes[arg.value.id].body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and target.id == arg.attr and isinstance(node.value, ast.Constant):
                return str(node.value.value)
    return None


def declared_in(path: Path, module: str) -> list[Declared]:
    """The algorithms a source file registers at module level (register_algorithm calls whose
    first argument is a string literal)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out = []
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if not isinstance(call, ast.Call):
            continue
        fn = call.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        if name == "register_algorithm" and call.args and isinstance(call.args[0], ast.Constant):
            out.append(Declared(str(call.args[0].value), module, _description(call, classes)))
    return out


@functools.cache
def builtin() -> tuple[Declared, ...]:
    """Every algorithm a file of fedheads/algorithms registers, in file-name order."""
    return tuple(d for f in sorted(_DIR.glob("*.py")) if not f.name.startswith("_")
                 for d in declared_in(f, f"{PACKAGE}.{f.stem}"))


@functools.cache
def installed() -> tuple[Declared, ...]:
    """The algorithms installed packages declare as entry points of the group `fedheads.algorithms`."""
    from importlib.metadata import entry_points

    return tuple(Declared(ep.name, ep.value.split(":", 1)[0], None) for ep in entry_points(group=GROUP))


def declared() -> list[Declared]:
    """The built-in algorithms, then the installed ones (a name declared twice: the first)."""
    seen: dict[str, Declared] = {}
    for d in (*builtin(), *installed()):
        seen.setdefault(d.name, d)
    return list(seen.values())


