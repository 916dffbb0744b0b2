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
    ours = "" if row.endswith(pub.method) else f" (ours: {pub.method})"  # a printed row compared with a variant
    return f"{exp.paper} {pub.where or exp.source}, row '{row}', column '{pub.column or header(pub.metric)}'{ours}"


def comparisons(exp: Experiment, views: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per published value: paper, ours (or why not), difference, beyond-spread flag.

    `paper` is what ours is compared with: the printed value, except for an Acc that averages
    domains our data lack (Digit-5's SVHN offline), where it is the paper's own mean over the
    domains we have (`paper_basis` says so), or None when the paper prints no per-domain values
    to form it (not comparable). With fewer than 2 finished seeds our spread is unknown: no
    difference is flagged beyond it (counts, which do not vary over seeds, still are)."""
    out = []
    for pub in exp.published:
        v = find_arm(views, pub.coords, pub.method)
        ours = None if v is None else v["values"].get(pub.metric)
        paper, paper_std, basis = _paper_value(exp, pub, v)
        entry: dict[str, Any] = {
            "point": ", ".join(f"{k}={x}" for k, x in pub.coords) or "-", "method": pub.method, "metric": pub.metric,
            "provenance": provenance(exp, pub), "paper": paper, "paper_std": paper_std, "paper_note": pub.note,
            "paper_printed": pub.value, "paper_printed_std": pub.std, "paper_basis": basis,
            "comparable": paper is not None or pub.value is None,
            "ours": None if ours is None else ours[0], "ours_std": None if ours is None else ours[1],
            "seeds_done": 0 if v is None else int(v.get("done", 0)),
            "why_missing": "" if ours is not None else _why_missing(v, pub.metric),
        }
        if ours is not None and paper is not None:
            diff = ours[0] - paper
            spread = (ours[1] or 0.0) + (paper_std or 0.0)
            judged = pub.metric in COUNTS or entry["seeds_done"] >= 2
            entry.update(diff=diff, spread=spread, spread_known=judged,
                         beyond=judged and abs(diff) > spread and pub.metric not in ("fixed_params",))
        out.append(entry)
    return out


def _paper_value(exp: Experiment, pub: Published, view: dict[str, Any] | None) -> tuple[float | None, float | None, str]:
    """(value, std, basis) ours is compared with; basis "" = the printed value as it is."""
    if pub.metric != "acc" or pub.value is None or view is None:
        return pub.value, pub.std, ""
    point = next((p for p in exp.points if p.coords == pub.coords), None)
    lack = () if point is None else datasets.missing_domains(point.data, bool(view.get("original_data")))
    if not lack:
        return pub.value, pub.std, ""
    ds = datasets.DATASETS[point.data.dataset]
    have = [d for d in (point.data.domains or ds.domains) if d not in lack]
    per = {p.metric.split(":", 1)[1]: p.value for p in exp.published
           if p.method == pub.method and p.coords == pub.coords and p.metric.startswith("domain:")}
    if have and all(per.get(d) is not None for d in have):
        mean = sum(per[d] for d in have) / len(have)
        return mean, None, (f"the paper's mean over {', '.join(have)} (the domains we have): its printed Acc "
                            f"also averages {', '.join(lack)}, which we lack")
    return None, None, (f"not comparable: the paper's Acc also averages {', '.join(lack)}, which we lack, and no "
                        f"per-domain values are printed to leave {'it' if len(lack) == 1 else 'them'} out")


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
    note = view.get("backbone_note") or ""
    if note.startswith("fallback"):  # describe what ran, not the stand-ins it replaced
        out.append(f"fallback backbones ({', '.join(view['backbones'])}) stand in for {point.backbones.label} "
                   "(the offline stand-ins are not available here: see Setting)")
    elif note and "paper's backbones" not in note:
        out.append(f"stand-in backbones ({', '.join(view['backbones'])}): {point.backbones.note}"
                   + ("" if note.startswith("stand-ins") else f" [{note}]"))
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


def _arm_value(views: Sequence[dict[str, Any]], coords: Any, method: str,
               metric: str) -> tuple[tuple[float, float] | None, int]:
    v = find_arm(views, coords, method)
    return (None, 0) if v is None else (v["values"].get(metric), int(v.get("done", 0)))


def check_claims(exp: Experiment, views: Sequence[dict[str, Any]], scale: str = "paper") -> list[dict[str, Any]]:
    """Each claim on each point it covers: holds / fails / not testable / not checked, with the margin."""
    out = []
    for cl in exp.claims:
        pts = [p for p in exp.points if _coords_match(p.coords, cl.where)]
        for p in pts:
            out.append(_one_claim(cl, p.coords, views, exp, scale))
    return out


def _one_claim(cl: Claim, coords: Any, views: Sequence[dict[str, Any]], exp: Experiment,
               scale: str = "paper") -> dict[str, Any]:
    label = cl.text + (f" [{', '.join(f'{k}={v}' for k, v in coords)}]" if len(exp.points) > 1 and not cl.where else "")
    best, n_best = _arm_value(views, coords, cl.best, cl.metric)
    if cl.against:
        names = {f"{cl.best} at {', '.join(f'{k}={v}' for k, v in cl.against)}": (cl.against, cl.best)}
    else:
        names = {n: (coords, n) for n in (cl.over or tuple(m.label for m in exp.methods if m.label != cl.best))}
    found = {k: _arm_value(views, c, m, cl.metric) for k, (c, m) in names.items()}
    rivals = {k: v for k, (v, _) in found.items() if v is not None}
    if best is None or not rivals:
        return {"claim": label, "status": "not checked", "detail": "needs the method and a rival with results"}
    pick = max if cl.direction == "higher" else min
    top_name, top = pick(rivals.items(), key=lambda kv: kv[1][0])
    margin = best[0] - top[0] if cl.direction == "higher" else top[0] - best[0]
    expected = "" if cl.magnitude is None else f"; the paper states {_range(cl)}" + (f" ('{cl.quote}')" if cl.quote else "")
    detail = (f"{cl.best} {fmt(cl.metric, best)} vs {'best' if cl.direction == 'higher' else 'lowest'} rival "
              f"{top_name} {fmt(cl.metric, top)}: margin {margin:+.2f}" + expected)
    seeds = min([n_best] + [found[k][1] for k in rivals])
    base = {"claim": label, "margin": margin, "direction": cl.direction, "magnitude": cl.magnitude, "seeds": seeds}
    if scale == "smoke" or seeds < 2:
        why = "smoke scale is a plumbing check" if scale == "smoke" else f"n={seeds}: one seed gives no spread"
        return {**base, "status": "not testable", "detail": f"{detail} ({why})"}
    in_range = cl.magnitude is None or cl.magnitude[0] <= margin <= cl.magnitude[1]
    status = "holds" if margin > 0 and in_range else "fails"
    within = abs(margin) <= (best[1] or 0) + (top[1] or 0)
    if margin > 0 and not in_range:
        detail += f" (the right direction, but {margin:+.2f} is outside {_range(cl)})"
    detail += " (within the seeds' spread)" if within else ""
    return {**base, "status": status, "within_spread": within, "in_range": in_range, "detail": detail}


def _range(cl: Claim) -> str:
    lo, hi = cl.magnitude or (0.0, 0.0)
    return f"a margin of {lo:g} to {hi:g}"


def citation(exp: Experiment) -> str:
    return f"{PAPERS.get(exp.paper, exp.paper)}, {exp.source}"
