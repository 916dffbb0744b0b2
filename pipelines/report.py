"""Per-experiment reports and the index page (docs/contracts.md, section 9).

    OUT/<experiment>/report.md      our table in the paper's layout (mean (std) over seeds), every
                                    published value beside ours with its provenance and the difference,
                                    a sentence on each deviation beyond the seeds' spread, the claims
    OUT/<experiment>/results.json   every arm (aggregate, metrics) and every cell (status, accuracy, error)
    OUT/<experiment>/cells.csv      one row per cell; table.csv: one row per (arm, metric) with the paper's
    OUT/<experiment>/*.png          the paper's figure form, and ours against the published values
    OUT/index.md                    links every experiment's report

`python -m pipelines report OUT` rebuilds all of it from plan.json and the cell files, so a report
of a sweep that is still running (or was killed) shows what is done and what is pending.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from embedcache.errors import UserError
from fedheads.report import metrics as fm
from fedheads.report import plotting
from fedheads.report.results import write_markdown, write_results_json
from pipelines import compare, figures, measures, registry, sweep
from pipelines.spec import Experiment

RESULTS_FORMAT = "pipelines-experiment/1"
LEGEND = ("cells: ours / paper (the published value, where the paper prints one); n/a: not available (see "
          "'Not run'); ·: not run at this scale; …: pending; -: not measured in our setting; †: the paper's mean "
          "over the domains we have; ‡: not comparable (see below)")


def load_views(exp: Experiment, plan: dict[str, Any], cells_dir: Path) -> list[dict[str, Any]]:
    """One view per planned arm: its plan entry, cell records, aggregate, metric values and curve."""
    metrics = set(exp.layout.metrics) | {p.metric for p in exp.published} | {c.metric for c in exp.claims}
    views = []
    for arm in plan["arms"]:
        recs = [sweep.load_record(cells_dir, h) for h in arm["cells"]]
        done = [r for r in recs if r and r["status"] == "done"]
        algorithm = arm["algorithm"] if arm["kind"] == "head" else arm["method"]
        agg = measures.aggregate(done, algorithm, arm["backbones"], arm["rounds"], arm.get("fraction") or 1.0)
        views.append({**arm, "records": recs, "done": len(done),
                      "failed": sum(1 for r in recs if r and r["status"] == "failed"),
                      "pending": sum(1 for r in recs if r is None), "aggregate": agg,
                      "values": measures.values(agg, done, sorted(metrics), arm["domain_map"]),
                      "curve": measures.curves(done) if exp.layout.figure == "curves" else []})
    return views


def _cell_text(v: dict[str, Any] | None, metric: str, pub: dict[str, Any] | None = None) -> str:
    """Our value, then " / " and the paper's where it prints one ("ours / paper")."""
    if v is None:
        ours = "·"
    elif v["unavailable"]:
        ours = "n/a"
    elif metric in v["values"]:
        ours = measures.fmt(metric, v["values"][metric])
    else:
        ours = "…" if v["pending"] else "-"
    if pub is None or pub.get("paper_printed") is None:
        return ours
    if pub.get("paper_basis") and pub.get("paper") is not None:
        return f"{ours} / {measures.fmt(metric, (pub['paper'], 0.0)).split('(')[0]}†"
    paper = measures.fmt(metric, (pub["paper_printed"], pub.get("paper_printed_std") or 0.0))
    return f"{ours} / {paper}" + ("" if pub.get("comparable", True) else "‡")


def paper_table(exp: Experiment, views: Sequence[dict[str, Any]], comps: Sequence[dict[str, Any]] = ()) -> str:
    """Our numbers laid out as the paper's table (rows / columns from exp.layout), each cell
    "ours / paper" where the paper prints a value for it."""
    lay = exp.layout
    pubs = {(c["point"], c["method"], c["metric"]): c for c in comps}
    rows: dict[tuple, dict[tuple, str]] = {}
    cols: list[tuple] = []
    for p in exp.points:
        for m in exp.methods:
            if p.methods is not None and m.label not in p.methods:
                continue
            v = compare.find_arm(views, p.coords, m.label)
            for metric in lay.metrics:
                coord = {**{k: str(x) for k, x in p.coords}, "method": m.label, "metric": measures.header(metric)}
                r = tuple(coord.get(k, "") for k in lay.rows)
                c = tuple(coord.get(k, "") for k in lay.columns)
                if c not in cols:
                    cols.append(c)
                rows.setdefault(r, {})[c] = _cell_text(v, metric, pubs.get((p.key(), m.label, metric)))
    head = [k.capitalize() if k == "method" else k for k in lay.rows] + [" / ".join(c) for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, cells in rows.items():
        lines.append("| " + " | ".join([*r, *(cells.get(c, "") for c in cols)]) + " |")
    return "\n".join(lines)


def _comparison_table(comps: Sequence[dict[str, Any]]) -> str:
    lines = ["| Published value (paper, table, row, column) | Paper | Ours | Difference |", "|---|---|---|---|"]
    for c in comps:
        printed = c.get("paper_printed", c["paper"])
        if printed is None:
            paper = f"not readable ({c['paper_note']})"
        else:
            paper = measures.fmt(c["metric"], (printed, c.get("paper_printed_std", c["paper_std"]) or 0))
            if c.get("paper_basis") and c["paper"] is not None:
                paper = f"{c['paper']:.2f}† (printed {paper})"
            elif not c.get("comparable", True):
                paper += "‡"
        ours = c["why_missing"] if c["ours"] is None else measures.fmt(c["metric"], (c["ours"], c["ours_std"] or 0))
        if c.get("diff") is not None:
            diff = compare._diff(c) + (" **beyond spread**" if c["beyond"] else "")
        else:
            diff = "not comparable" if not c.get("comparable", True) and c["ours"] is not None else "-"
        lines.append(f"| {c['provenance']} | {paper} | {ours} | {diff} |")
    return "\n".join(lines)


def figure_title(exp: Experiment, views: Sequence[dict[str, Any]]) -> str:
    """"<paper table/figure>: <datasets>, <backbones>" (the data sets and backbones the plotted arms ran)."""
    ran = {tuple(tuple(c) for c in v["coords"]) for v in views}
    datasets = ", ".join(sorted({p.data.dataset for p in exp.points if not views or p.coords in ran}))
    bbs = sorted({b for v in views for b in v.get("backbones") or ()})
    return plotting.title(compare.citation(exp), datasets, bbs if len(bbs) <= 3 else f"{len(bbs)} backbones")


def _figures(exp: Experiment, views: Sequence[dict[str, Any]], comps: Sequence[dict[str, Any]], edir: Path) -> list[str]:
    """The paper's figure form for this experiment, plus ours vs published; returns the file names."""
    made: list[str] = []
    fig = exp.layout.figure
    ok = [v for v in views if v["values"]]
    title = figure_title(exp, ok)
    if fig.startswith("vs:") and ok:
        axis = fig[3:]
        series: dict[str, list] = {}
        for v in ok:
            x = dict((k, x) for k, x in v["coords"]).get(axis)
            rest = ", ".join(str(c) for k, c in v["coords"] if k != axis)  # one line per method and other point
            if "acc" in v["values"] and x is not None:
                series.setdefault(f"{v['method']} ({rest})" if rest else v["method"], []).append((x, *v["values"]["acc"]))
        if series:
            figures.lines(series, axis, edir / "figure.png", title)
            made.append("figure.png")
    elif fig == "curves":
        for i, p in enumerate(exp.points):
            per = {v["method"]: v["curve"] for v in views
                   if [tuple(c) for c in v["coords"]] == list(p.coords) and v["curve"]}
            if per:
                name = f"figure_{i}.png"
                figures.curves(per, edir / name, f"{title}: {p.key()}")
                made.append(name)
    elif fig == "fairness" and ok:
        groups: dict[str, dict[str, dict]] = {}
        for v in ok:
            groups.setdefault(v["point"], {})[v["method"]] = v["values"]
        keys = exp.layout.metrics
        figures.fairness_bars(groups, keys, [measures.header(k) for k in keys], edir / "figure.png", title)
        made.append("figure.png")
    elif fig.startswith("grid:") and ok:
        xname, yname = fig[5:].split(",")
        panels: dict[str, dict] = {}
        for v in ok:
            c = dict((k, x) for k, x in v["coords"])
            key = f"{c.get('dataset', '')} {v['method']}".strip()
            panels.setdefault(key, {})[(c[xname], c[yname])] = v["values"].get("acc", (float("nan"), 0))[0]
        for i, (key, cells) in enumerate(panels.items()):
            xs = sorted({x for x, _ in cells}, reverse=True)
            ys = sorted({y for _, y in cells}, reverse=True)
            figures.grid(cells, xs, ys, xname, yname, edir / f"figure_{i}.png", f"{title}: {key}")
            made.append(f"figure_{i}.png")
    pairs = [(c["provenance"], c["paper"], c["ours"], c["ours_std"] or 0.0, c["method"]) for c in comps
             if c["ours"] is not None and c["paper"] is not None and c["metric"] not in measures.COUNTS + measures.SCIENTIFIC]
    if pairs:
        figures.paper_vs_ours(pairs, edir / "paper_vs_ours.png", title)
        made.append("paper_vs_ours.png")
    return made


def _comparison_notes(comps: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for mark, means in (("†", True), ("‡", False)):
        bases = dict.fromkeys(c["paper_basis"] for c in comps
                              if c.get("paper_basis") and (c["paper"] is not None) == means)
        out += [f"{mark} Acc is compared with {b}." if means else f"{mark} {b}." for b in bases]
    if any(c.get("diff") is not None and not c.get("spread_known", True) for c in comps):
        out.append("With fewer than 2 seeds our spread is unknown (n=1): no difference is judged against it "
                   "(only counts, which do not vary over seeds).")
    return [""] + out if out else []


def _no_deviation(comps: Sequence[dict[str, Any]]) -> str:
    if any(c.get("diff") is not None and not c.get("spread_known", True) for c in comps):
        return "none judged: fewer than 2 seeds give no spread of ours"
    return "none"


def portable_paths(text: str, edir: Path) -> str:
    """Paths under the run's output folder relative to the report, the home folder as "~" (a
    report is shared; the user's absolute paths say nothing to its reader)."""
    out = Path(edir).resolve().parent
    for root, rel in ((Path(edir).resolve(), "."), (out, "..")):
        text = text.replace(f"{root}/", f"{rel}/")
    home = str(Path.home())
    if home not in ("/", ""):
        text = text.replace(f"{home}/", "~/")
    return text


def _header_lines(exp: Experiment, plan: dict[str, Any], views: Sequence[dict[str, Any]]) -> list[str]:
    n = {k: sum(v[k] for v in views) for k in ("done", "failed", "pending")}
    t = plan.get("timing", {})
    sc = exp.scale(plan["scale"])
    scale = (f"**{plan['scale']}** scale" + ("" if plan["scale"] == "paper" else
             f" ({f'{sc.rounds} rounds' if sc.rounds else 'each method its paper rounds'}, seeds {list(sc.seeds or exp.seeds)}"
             + (f", at most {sc.test_per_class} test images per class" if sc.test_per_class else "") + ")"))
    lines = [f"# {exp.paper} {exp.source}: {exp.title}", "", f"*{compare.citation(exp)}.* {exp.summary}", "",
             f"- {scale}; paper protocol: {exp.rounds} rounds unless a method says otherwise, seeds {list(exp.seeds)}; "
             f"scheduler {plan.get('scheduler')}.",
             f"- cells: {n['done']} done, {n['failed']} failed, {n['pending']} pending; "
             f"{sum(1 for v in views if v['unavailable'])} of {len(views)} arms not available."]
    swapped = (plan.get("context") or {}).get("backbone_map") or {}
    if swapped:
        lines.append(f"- backbones replaced (--backbone): {', '.join(f'{a} -> {b}' for a, b in swapped.items())}; "
                     "the summary above names the experiment's own.")
    if t.get("sweep_seconds") is not None:
        lines.append(f"- time: prepare {t['prepare_seconds']:.1f} s, sweep {t['sweep_seconds']:.1f} s "
                     f"({t['cells_to_run']} of {t['cells']} cells run; the rest were already complete).")
    lines.append(f"- cells are mean (std) over seeds of the client-average accuracy in percent; "
                 f"{fm.std_convention(fm.STD_DDOF)}.")
    return lines


def _setting_lines(views: Sequence[dict[str, Any]]) -> list[str]:
    seen, out = set(), []
    for v in views:
        trainable = (v.get("settings") or {}).get("trainable") if v.get("kind") == "finetune" else None
        for line in (v["data_note"] and f"data ({v['point']}): {v['data_note']}",
                     v["backbones"] and f"backbones ({v['point']}): {', '.join(v['backbones'])}, {v['backbone_note']}",
                     trainable and v["backbones"] and
                     f"fine-tuned ({v['point']}): {v['backbones'][0]} with --set trainable={trainable}"):
            if line and line not in seen:
                seen.add(line)
                out.append(f"- {line}")
    return out


def write_experiment(exp: Experiment, edir: Path, cells_dir: Path) -> dict[str, Any]:
    """Write report.md, results.json, cells.csv, table.csv and the figures of one experiment."""
    plan_path = edir / "plan.json"
    if not plan_path.is_file():
        raise UserError(f"{edir}: no plan.json (run `python -m pipelines run {exp.name}` first)")
    plan = json.loads(plan_path.read_text())
    views = load_views(exp, plan, cells_dir)
    comps = compare.comparisons(exp, views)
    claims = compare.check_claims(exp, views, plan["scale"])
    devs = compare.deviation_sentences(exp, views, comps, plan["scale"])
    pngs = _figures(exp, views, comps, edir)
    md = _header_lines(exp, plan, views) + ["", "## Setting", ""] + _setting_lines(views)
    md += ["", "## Our results, in the paper's layout", "", paper_table(exp, views, comps), "", LEGEND]
    if comps:
        md += ["", "## Published values beside ours", "", _comparison_table(comps), "",
               "A difference is *beyond spread* when it exceeds our std over seeds plus the paper's printed std."]
        md += _comparison_notes(comps)
    md += ["", "## Deviations beyond the seeds' spread", ""] + ([f"- {d}" for d in devs] or [f"- {_no_deviation(comps)}"])
    if claims:
        md += ["", "## The paper's claims, on our numbers", ""]
        md += [f"- **{c['status']}**: {c['claim']}. {c.get('detail', '')}" for c in claims]
    not_run = [v for v in views if v["unavailable"] or v["failed"]]
    if not_run:
        md += ["", "## Not run", ""]
        def why(v: dict) -> str:
            errors = sorted({r["error"] for r in v["records"] if r and r["status"] == "failed"})
            return v["unavailable"] or f"{v['failed']} cell(s) failed: " + "; ".join(errors)
        md += [f"- {v['point']} / {v['method']}: {why(v)}" for v in not_run]
    if exp.notes:
        md += ["", "## Notes", ""] + [f"- {n}" for n in exp.notes]
    md += [""] + [f"![{p}]({p})" for p in pngs]
    write_markdown(portable_paths("\n".join(md) + "\n", edir), edir / "report.md")
    _write_tables(exp, plan, views, comps, edir)
    write_results_json(_results(exp, plan, views, comps, claims, devs), edir / "results.json")
    return {"done": sum(v["done"] for v in views), "failed": sum(v["failed"] for v in views),
            "pending": sum(v["pending"] for v in views), "unavailable": sum(1 for v in views if v["unavailable"]),
            "arms": len(views), "why": next((v["unavailable"] for v in views if v["unavailable"]), "")}


def _results(exp: Experiment, plan: dict[str, Any], views: Sequence[dict[str, Any]], comps: list, claims: list,
             devs: list) -> dict[str, Any]:
    arms = []
    for v in views:
        agg = v["aggregate"] or {}
        arms.append({k: v[k] for k in ("coords", "point", "method", "kind", "rounds", "seeds", "backbones",
                                        "unavailable", "done", "failed", "pending", "cells")}
                    | {"values": {m: {"mean": a, "std": s} for m, (a, s) in v["values"].items()},
                       "aggregate": {k: agg.get(k) for k in ("accuracy", "accuracy_cell", "per_client", "fairness",
                                                             "fairness_std", "communication", "history")},
                       "curve": v["curve"]})
    cells = [{"hash": r["hash"], **r["labels"], "status": r["status"], "error": r.get("error"),
              "accuracy": _cell_acc(r), "wall_seconds": r.get("timing", {}).get("wall_seconds")}
             for v in views for r in v["records"] if r]
    return {"format": RESULTS_FORMAT, "experiment": exp.name, "paper": compare.citation(exp), "title": exp.title,
            "scale": plan["scale"], "scheduler": plan.get("scheduler"), "context": plan.get("context"),
            "std_convention": fm.std_convention(fm.STD_DDOF), "timing": plan.get("timing"), "arms": arms,
            "cells": cells, "comparison": comps, "claims": claims, "deviations": devs}


def _cell_acc(rec: dict[str, Any]) -> float | None:
    if rec.get("status") != "done":
        return None
    pc = rec["result"]["seed_result"]["per_client"]
    return sum(pc.values()) / len(pc) if pc else None


def _write_tables(exp: Experiment, plan: dict[str, Any], views: Sequence[dict[str, Any]], comps: list, edir: Path) -> None:
    axes = [a for a, _ in exp.axes] or sorted({k for v in views for k, _ in v["coords"]})
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["experiment", "scale", *axes, "method", "seed", "status", "accuracy", "wall_seconds", "hash", "error"])
    for v in views:
        c = dict((k, x) for k, x in v["coords"])
        for h, r in zip(v["cells"], v["records"]):
            w.writerow([exp.name, plan["scale"], *(c.get(a, "") for a in axes), v["method"],
                        r["labels"]["seed"] if r else "", r["status"] if r else "pending",
                        "" if not r or _cell_acc(r) is None else round(_cell_acc(r), 4),
                        (r or {}).get("timing", {}).get("wall_seconds", ""), h, (r or {}).get("error", "") or ""])
    write_markdown(buf.getvalue(), edir / "cells.csv")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["experiment", *axes, "method", "metric", "mean", "std", "paper", "paper_std", "diff", "provenance"])
    pub = {(c["point"], c["method"], c["metric"]): c for c in comps}
    for v in views:
        c = dict((k, x) for k, x in v["coords"])
        for m, (a, s) in v["values"].items():
            p = pub.get((v["point"], v["method"], m), {})
            w.writerow([exp.name, *(c.get(x, "") for x in axes), v["method"], m, round(a, 6), round(s, 6),
                        p.get("paper", ""), p.get("paper_std", "") or "", "" if p.get("diff") is None else
                        round(p["diff"], 4), p.get("provenance", "")])
    write_markdown(buf.getvalue(), edir / "table.csv")


def write_index(out: Path) -> Path:
    """OUT/index.md: one line per experiment report found under OUT."""
    lines = ["# Reproduction index", "", "| Experiment | Paper | What | Scale | Cells done / failed | Claims held | Report |",
             "|---|---|---|---|---|---|---|"]
    for exp in registry.experiments():
        res = out / exp.name / "results.json"
        if not res.is_file():
            continue
        r = json.loads(res.read_text())
        cl = r.get("claims", [])
        nt = sum(c["status"] == "not testable" for c in cl)
        held = (f"{sum(c['status'] == 'holds' for c in cl)} / {len(cl)}" + (f" ({nt} not testable)" if nt else "")
                if cl else "-")
        done = sum(1 for c in r["cells"] if c["status"] == "done")
        failed = sum(1 for c in r["cells"] if c["status"] == "failed")
        na = sum(1 for a in r["arms"] if a["unavailable"])
        lines.append(f"| {exp.name} | {exp.paper} {exp.source} | {exp.title} | {r['scale']} | {done} / {failed}"
                     + (f" ({na} arms n/a)" if na else "") + f" | {held} | [report]({exp.name}/report.md) |")
    return write_markdown("\n".join(lines) + "\n", out / "index.md")
