"""`fedheads summarize RUN_DIR...`: one table across runs, from their results.json files
(docs/contracts.md, sections 6 and 7): a `train` run gives one row, a `compare` or multi-head
`finetune` directory one row per algorithm (its `algorithms` mapping), a `finetune` run one row.

Columns: run, algorithm, backbones, rounds, seeds, clients (with / without test samples),
accuracy "mean(std)" and its parts, the worst 10 % of clients, the measured upload, wall time.
Markdown for people, CSV (plain numbers) for scripts; written atomically, with each run's path
relative to the written file's folder."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from embedcache.atomic import atomic_path
from embedcache.errors import UserError

COLUMNS = ("run", "algorithm", "backbones", "rounds", "seeds", "clients", "clients_without_test",
           "accuracy", "accuracy_mean", "accuracy_std", "worst_10", "upload_bytes_total", "wall_seconds")


def _read(run: Path) -> dict[str, Any]:
    path = run / "results.json" if run.is_dir() else run
    if not path.is_file():
        raise UserError(f"{run}: no results.json (not a finished train, compare or finetune run)")
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: not a results.json object")
    return obj


def _entries(res: Mapping[str, Any], where: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(name, one run's results) of a run or of each member of a comparison."""
    members = res.get("algorithms")
    if isinstance(members, Mapping):
        for name, r in members.items():
            if not isinstance(r, Mapping) or "accuracy" not in r:
                raise UserError(f"{where}: algorithm {name!r} has no accuracy")
            yield name, r
    elif "accuracy" in res:
        yield str(res.get("algorithm") or res.get("method") or "?"), res
    else:
        raise UserError(f"{where}: neither an accuracy nor algorithms (not a fedheads results.json)")


def _row(run: str, name: str, r: Mapping[str, Any]) -> dict[str, Any]:
    acc = r.get("accuracy") or {}
    per_client = r.get("per_client") or {}
    timing = r.get("timing") or {}
    bbs = r.get("backbones") or ([r["backbone"]] if r.get("backbone") else [])
    return {"run": run, "algorithm": name, "backbones": ",".join(map(str, bbs)),
            "rounds": r.get("rounds"), "seeds": ",".join(str(s) for s in r.get("seeds", [])),
            "clients": len(per_client), "clients_without_test": len(r.get("clients_without_test") or []),
            "accuracy": r.get("accuracy_cell", ""), "accuracy_mean": acc.get("mean"),
            "accuracy_std": acc.get("std"), "worst_10": (r.get("fairness") or {}).get("worst_10"),
            "upload_bytes_total": (r.get("communication") or {}).get("upload_bytes_total"),
            "wall_seconds": timing.get("wall_seconds")}


def summarize(runs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """One row per (run directory, algorithm), in the order given (UserError on a directory
    without a readable results.json)."""
    if not runs:
        raise UserError("RUN_DIR: give at least one run directory")
    rows = []
    for run in runs:
        res = _read(Path(run))
        rows += [_row(str(run), name, r) for name, r in _entries(res, str(run))]
    return rows


def _md_cell(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1e6 else f"{v:.3g}"
    return str(v).replace("|", "\\|")


def to_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    cols = [c for c in COLUMNS if c not in ("accuracy_mean", "accuracy_std")]  # the cell holds both
    head = "| " + " | ".join(cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(_md_cell(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body]) + "\n"


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COLUMNS), lineterminator="\n")
    w.writeheader()
    w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    return buf.getvalue()


def write_table(rows: Sequence[Mapping[str, Any]], out: str | Path) -> Path:
    """`out` ending in .md or .csv, written atomically."""
    out = Path(out)
    kind = out.suffix.lower()
    if kind not in (".md", ".csv"):
        raise UserError(f"--out {out}: must end in .md or .csv")
    from fedheads.report.results import relative_paths

    # runs named relative to the table's folder: no absolute (home) path in a written report
    rows = [{**r, "run": relative_paths(os.path.abspath(r["run"]), out.parent)} for r in rows]
    text = to_markdown(rows) if kind == ".md" else to_csv(rows)
    with atomic_path(out) as tmp:
        tmp.write_text(text)
    return out
