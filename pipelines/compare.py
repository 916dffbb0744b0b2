"""Published values beside ours, the deviations larger than the seeds' spread with their likely
causes, and the papers' ordering claims checked on our numbers.

A difference counts as a deviation when |ours - paper| > (our std over seeds) + (the paper's
printed std): both are the spread of 3 runs, so a gap inside their sum is not evidence of a
difference. Each deviation is explained by what we know differs: stand-in data, stand-in
backbones, a reduced scale, a code-vs-paper choice, or a note on the published value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipelines import datasets
from pipelines.measures import COUNTS, fmt, header
from pipelines.registry import PAPERS
from pipelines.spec import Claim, Experiment, Published


def _coords_match(coords: Sequence[Sequence[Any]], where: Sequence[tuple[str, Any]]) -> bool:
    d = {k: v for k, v in coords}
    return all(d.get(k) == v for k, v in where)


def find_arm(views: Sequence[dict[str, Any]], coords: Sequence[tuple[str, Any]], method: str) -> dict[str, Any] | None:
    for v in views:
        if v["method"] == method and [tuple(c) for c in v["coords"]] == [tuple(c) for c in coords]:
            return v
    return None


def provenance(exp: Experiment, pub: Published) -> str:
    row = pub.row or " ".join([*(str(v) for _, v in pub.coords), pub.method])
    return f"{exp.paper} {pub.where or exp.source}, row '{row}', column '{pub.column or header(pub.metric)}'"


def comparisons(exp: Experiment, views: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per published value: paper, ours (or why not), difference, beyond-spread flag."""
    out = []
    for pub in exp.published:
        v = find_arm(views, pub.coords, pub.method)
        ours = None if v is None else v["values"].get(pub.metric)
        entry: dict[str, Any] = {
            "point": ", ".join(f"{k}={x}" for k, x in pub.coords) or "-", "method": pub.method, "metric": pub.metric,
            "provenance": provenance(exp, pub), "paper": pub.value, "paper_std": pub.std, "paper_note": pub.note,
            "ours": None if ours is None else ours[0], "ours_std": None if ours is None else ours[1],
            "why_missing": "" if ours is not None else _why_missing(v, pub.metric),
        }
        if ours is not None and pub.value is not None:
            diff = ours[0] - pub.value
            spread = (ours[1] or 0.0) + (pub.std or 0.0)
            entry.update(diff=diff, spread=spread, beyond=abs(diff) > spread and pub.metric not in ("fixed_params",))
        out.append(entry)
    return out


def _why_missing(view: dict[str, Any] | None, metric: str) -> str:
    if view is None:
        return "not run at this scale"
    if view.get("unavailable"):
        return view["unavailable"]
    if view.get("done", 0) == 0:
        return "no finished cell" + (f" ({view['failed']} failed)" if view.get("failed") else "")
    if metric.startswith("domain:") and metric.split(":", 1)[1] not in view.get("domain_map", {}):
        return "no stand-in for this domain"
    return "not measured in our setting"


def reasons(exp: Experiment, view: dict[str, Any], pub_note: str, scale: str, metric: str) -> list[str]:
    """What differs from the paper for this arm, most specific first."""
    out = []
    m = exp.method(view["method"])
    if m.note:
        out.append(m.note)
    if pub_note:
        out.append(f"published value: {pub_note}")
    point = next(p for p in exp.points if [list(c) for c in p.coords] == [list(c) for c in view["coords"]])
    ds = datasets.DATASETS[point.data.dataset]
    if not view.get("original_data") and ds.standin_note:
        out.append(f"stand-in data: {ds.standin_note}")
    if metric.startswith("domain:") and metric.split(":", 1)[1] not in view.get("domain_map", {}):
        out.append("no stand-in for this domain")
    if view.get("backbone_note") and "paper's backbones" not in view["backbone_note"]:
        out.append(f"stand-in backbones ({', '.join(view['backbones'])}): {point.backbones.note}"
                   + ("" if view["backbone_note"].startswith("stand-ins") else f" [{view['backbone_note']}]"))
    if metric in ("comm_params", "train_params"):
        out.append(f"feature dimensions differ: ours {'+'.join(str(d) for d in view.get('dims', []))}, "
                   f"the paper's {len(point.backbones.paper)} x 512")
    if scale != "paper":
        paper_rounds = dict(point.rounds).get(m.label) or m.paper_rounds or exp.rounds
        out.append(f"{scale} scale: {view['rounds']} rounds (paper: {paper_rounds}), seeds {view['seeds']}"
                   + (", capped test sets" if "test_per_class" in view.get("recipe", {}) else ""))
    if point.data.note:
        out.append(f"our reading of the setting: {point.data.note}")
    return out


def deviation_sentences(exp: Experiment, views: Sequence[dict[str, Any]], comps: Sequence[dict[str, Any]],
                        scale: str) -> list[str]:
    """A sentence per arm listing its values beyond the spread, with the likely causes; causes every
    deviating arm shares come first, once."""
    by_arm: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in comps:
        if c.get("beyond"):
            by_arm.setdefault((c["point"], c["method"]), []).append(c)
    per_arm = []
    for (point, method), items in by_arm.items():
        pub = next(p for p in exp.published if p.method == method
                   and (", ".join(f"{k}={x}" for k, x in p.coords) or "-") == point)
        view = find_arm(views, pub.coords, method)
        assert view is not None
        why: list[str] = []
        for c in items:
            why += [w for w in reasons(exp, view, c["paper_note"], scale, c["metric"]) if w not in why]
        per_arm.append((point, method, items, why))
    if not per_arm:
        return []
    common = [w for w in per_arm[0][3] if all(w in why for *_, why in per_arm)] if len(per_arm) > 1 else []
    out = [f"Causes common to every deviation below: {'; '.join(common)}."] if common else []
    for point, method, items, why in per_arm:
        cells = "; ".join(f"{header(c['metric'])} {fmt(c['metric'], (c['ours'], c['ours_std'] or 0))} vs "
                          f"{fmt(c['metric'], (c['paper'], c['paper_std'] or 0))} ({_diff(c)})" for c in items)
        own = [w for w in why if w not in common]
        where = f"{point} / {method}" if point != "-" else method
        tail = ("; ".join(own) if own else "the common causes above" if common else
                "none we know of (same data, backbones and protocol)")
        out.append(f"**{where}**: {cells}. Likely causes: {tail}.")
    return out


def _diff(c: dict[str, Any]) -> str:
    return f"{int(round(c['diff'])):+,}" if c["metric"] in COUNTS else f"{c['diff']:+.2f}"


def _value(views: Sequence[dict[str, Any]], coords: Any, method: str, metric: str) -> tuple[float, float] | None:
    v = find_arm(views, coords, method)
    return None if v is None else v["values"].get(metric)


def check_claims(exp: Experiment, views: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each claim on each point it covers: holds / fails / cannot be checked, with the margin."""
    out = []
    for cl in exp.claims:
        pts = [p for p in exp.points if _coords_match(p.coords, cl.where)]
        for p in pts:
            out.append(_one_claim(cl, p.coords, views, exp))
    return out


def _one_claim(cl: Claim, coords: Any, views: Sequence[dict[str, Any]], exp: Experiment) -> dict[str, Any]:
    label = cl.text + (f" [{', '.join(f'{k}={v}' for k, v in coords)}]" if len(exp.points) > 1 and not cl.where else "")
    best = _value(views, coords, cl.best, cl.metric)
    if cl.against:
        rivals = {f"{cl.best} at {', '.join(f'{k}={v}' for k, v in cl.against)}":
                  _value(views, cl.against, cl.best, cl.metric)}
    else:
        names = cl.over or tuple(m.label for m in exp.methods if m.label != cl.best)
        rivals = {n: _value(views, coords, n, cl.metric) for n in names}
    rivals = {k: v for k, v in rivals.items() if v is not None}
    if best is None or not rivals:
        return {"claim": label, "status": "not checked", "detail": "needs the method and a rival with results"}
    top_name, top = max(rivals.items(), key=lambda kv: kv[1][0])
    margin = best[0] - top[0]
    status = "holds" if margin > 0 else "fails"
    within = abs(margin) <= (best[1] or 0) + (top[1] or 0)
    detail = (f"{cl.best} {fmt(cl.metric, best)} vs best rival {top_name} {fmt(cl.metric, top)}: "
              f"{margin:+.2f}" + (" (within the seeds' spread)" if within else ""))
    return {"claim": label, "status": status, "margin": margin, "within_spread": within, "detail": detail}


def citation(exp: Experiment) -> str:
    return f"{PAPERS.get(exp.paper, exp.paper)}, {exp.source}"
