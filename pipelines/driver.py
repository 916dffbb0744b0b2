"""`python -m pipelines run`: plan -> prepare (driver) -> sweep (dask) -> report, per experiment.

    OUT/<experiment>/plan.json     the resolved arms and their cells' hashes (written before the sweep)
    OUT/<experiment>/report.md ... the report (pipelines.report), rewritten after the sweep
    OUT/cells/<hash>.json          one finished cell (shared by every experiment of OUT)
    OUT/index.md                   links every experiment's report
    CACHE/                         manifests, feature pools, stores (pipelines.prepare); OUT/cache by default

Experiments run one after another on one dask client, so that each has its own timing; cells
that several experiments share (same hash) run once.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from embedcache.atomic import atomic_path
from embedcache.errors import UserError
from pipelines import plan, prepare, report, sweep
from pipelines.spec import Experiment

PLAN_FORMAT = "pipelines-plan/1"


def _write_json(path: Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def _prepare_arms(arms: list[plan.Arm], ctx: plan.RunContext, cache: Path, scheduler: str, progress: bool) -> float:
    """Partition and features for every runnable arm, each distinct request once; a failure marks the
    arms that need it (with the error) and the others go on."""
    t0 = time.perf_counter()
    done: dict[tuple, prepare.Prepared | str] = {}
    extract_on = scheduler if scheduler.startswith(("tcp://", "tls://")) else None  # local: in-process (faster on few cores)
    for arm in arms:
        if arm.unavailable or arm.data is None:
            continue
        names = plan.extra_backbones(arm)
        key = (arm.data, tuple(names))
        if key not in done:
            try:
                done[key] = prepare.prepare(arm.data, names, cache, weights_dir=ctx.weights_dir,
                                            scheduler=extract_on, progress=progress)
            except UserError as exc:
                done[key] = f"data preparation failed: {exc}"
                print(f"error: {arm.point.key()}: {exc}", file=sys.stderr)
        got = done[key]
        if isinstance(got, str):
            arm.unavailable = got
        else:
            arm.prepared = got
            arm.cells = plan.cells(arm, ctx)
    return time.perf_counter() - t0


def _plan_json(exp: Experiment, ctx: plan.RunContext, arms: list[plan.Arm], scheduler: str,
               timing: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": PLAN_FORMAT, "experiment": exp.name, "scale": ctx.scale, "scheduler": scheduler,
        "context": {"sources": dict(ctx.sources), "originals": ctx.originals, "device": ctx.device,
                    "threads": ctx.threads, "backbone_map": dict(ctx.backbone_map)},
        "arms": [{"coords": [list(c) for c in a.point.coords], "point": a.point.key(), "method": a.method.label,
                  "kind": a.method.kind, "algorithm": a.method.algorithm, "rounds": a.rounds, "seeds": list(a.seeds),
                  "settings": a.settings, "backbones": list(a.backbones), "backbone_note": a.backbone_note,
                  "data_note": a.data_note, "unavailable": a.unavailable,
                  "domain_map": dict(a.data.domain_map) if a.data else {},
                  "original_data": bool(a.data and a.data.original),
                  "recipe": dict(a.data.recipe) if a.data else {},
                  "dims": [a.prepared.features["backbones"][b]["dim"] for b in a.backbones
                           if b in a.prepared.features["backbones"]] if a.prepared else [],
                  "manifest": str(a.prepared.manifest_path) if a.prepared else None,
                  "store": str(a.prepared.store) if a.prepared and a.prepared.store else None,
                  "prepare_notes": a.prepared.notes if a.prepared else [],
                  "fraction": a.cells[0]["config"]["options"]["fraction"] if a.cells else None,
                  "cells": [c["hash"] for c in a.cells]} for a in arms],
        "timing": timing,
    }


def run_experiments(exps: Sequence[Experiment], ctx: plan.RunContext, out: Path, *, scheduler: str,
                    cache: Path | None = None, force: bool = False, progress: bool = True,
                    ) -> dict[str, dict[str, int]]:
    """Run each experiment; returns {name: {"done", "failed", "unavailable", ...}}."""
    out.mkdir(parents=True, exist_ok=True)
    cache = cache or out / "cache"
    cells_dir = out / "cells"
    summary: dict[str, dict[str, int]] = {}
    with contextlib.ExitStack() as stack:
        client = None
        for exp in exps:
            t0 = time.perf_counter()
            arms = plan.arms(exp, ctx)
            prep_s = _prepare_arms(arms, ctx, cache, scheduler, progress)
            cells = [c for a in arms for c in a.cells]
            todo = [c for c in cells if force or (sweep.load_record(cells_dir, c["hash"]) or {}).get("status") != "done"]
            if todo and scheduler != "serial" and client is None:
                from embedcache.distributed import dask_client

                client = stack.enter_context(dask_client(scheduler, worker_env=sweep.WORKER_ENV))
            timing = {"prepare_seconds": round(prep_s, 3), "cells": len({c["hash"] for c in cells}),
                      "cells_to_run": len({c["hash"] for c in todo}), "started": time.time()}
            edir = out / exp.name
            _write_json(edir / "plan.json", _plan_json(exp, ctx, arms, scheduler, timing))
            t1 = time.perf_counter()
            sweep.run_cells(cells, cells_dir, scheduler, force=force, progress=progress, desc=exp.name,
                            client=client)
            timing.update(sweep_seconds=round(time.perf_counter() - t1, 3),
                          total_seconds=round(time.perf_counter() - t0, 3))
            _write_json(edir / "plan.json", _plan_json(exp, ctx, arms, scheduler, timing))
            summary[exp.name] = report.write_experiment(exp, edir, cells_dir)
        report.write_index(out)
    return summary
