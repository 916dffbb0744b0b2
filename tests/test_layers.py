"""The fedheads packages stand on floors and import only downwards (0 arrows back up): a module
imports modules of its own package or of a package on a lower floor, never of one above it, so
each floor can be understood, tested and replaced with what lies below it only. Counted over
every import statement (module level, inside functions and under TYPE_CHECKING alike)."""

from __future__ import annotations

import ast
from pathlib import Path

import fedheads

ROOT = Path(fedheads.__file__).parent
# floor of each room: a package (directory) or a top-level module of fedheads
FLOORS = {
    "core": 1, "version": 1, "children": 1, "privacy_accounting": 1, "algorithm_names": 1,
    "algorithms": 2, "privacy": 2,
    "report": 3,
    "run": 4,
    "prediction": 5, "finetuning": 5, "flower": 5,
    "alignment": 6, "api": 6, "result": 6,
    "cli": 7, "__init__": 7,
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "fedheads" and len(parts) > 1 else ("__init__" if module == "fedheads" else None)


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: within its own package
                continue
            mod = node.module or ""
            out += [(node.lineno, f"{mod}.{a.name}" if mod == "fedheads" else mod) for a in node.names]
    return out


def test_every_room_has_a_floor():
    rooms = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file()))}
    assert rooms == set(FLOORS), f"rooms without a floor: {sorted(rooms - set(FLOORS))}"


def test_no_import_runs_back_up():
    up = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        me = _room(".".join(rel.parts))
        for line, mod in _imports(path, ".".join(rel.parts[:-1])):
            room = _room(mod)
            if room is None or room == me or room not in FLOORS:
                continue
            if FLOORS[room] > FLOORS[me]:
                up.append(f"{rel}.py:{line} (floor {FLOORS[me]}) imports {mod} (floor {FLOORS[room]})")
    assert not up, "imports that run back up:\n" + "\n".join(up)
