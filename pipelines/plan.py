"""An experiment at a scale -> arms (point x method) -> cells (arm x seed), each addressed by the
hash of its full resolved configuration (docs/contracts.md, section 9).

Resolution happens in two steps: `arms()` decides, without touching data, what runs and what
cannot (a method or point whose code, data or backbones are not available says why); `cells()`
then builds each cell's configuration from the prepared data (manifest hash and the store's
backbone fingerprint are part of the hash, paths are not).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

from embedcache.errors import UserError, did_you_mean
from embedcache.manifest import canonical_json
from pipelines import datasets
from pipelines.prepare import DataRequest, Prepared
from pipelines.spec import BackboneSet, Experiment, Method, Point

CELL_FORMAT = "pipelines-cell/1"
# head cells that train differently from the same config of older code carry a key of what
# changed, so a re-run does not reuse their old results (the other cells keep their hashes):
# FedPCL, FedProto and Solo seed each client's head by its global id (core/heads.client_seeds),
# no longer by its place in the largest-first stack of a full-participation cell
RESEEDED = ("fedpcl", "fedproto", "solo")
OPTION_KEYS = ("fraction", "engine", "binarize", "dp", "head_from")  # cell options set by settings
# (dp: the fields of a fedheads.privacy.Mechanism as (name, value) pairs; a method's dp refines its
# point's field by field. head_from: an algorithm whose head the cell trains first and calibrates, cells.run_head)
# FinetuneOptions fields a setting may name (ft.* goes to FTConfig)
FINETUNE_KEYS = ("head_rounds", "trainable", "bn", "live_prefix", "pretrained", "augment", "ncm_bias", "fraction")


@dataclass(frozen=True)
class RunContext:
    """What the command line decides for every experiment of a run."""

    scale: str = "ci"
    sources: tuple[tuple[str, str], ...] = ()  # --source KEY=SPEC
    originals: bool = False  # --originals: the papers' backbones instead of the stand-ins
    device: str = "cpu"  # cells run here (part of the hash: results differ across devices)
    threads: int = 1  # torch threads per cell (part of the hash); parallelism is across cells
    weights_dir: str | None = None
    backbone_map: tuple[tuple[str, str], ...] = ()  # --backbone NAME=OTHER: replace a backbone everywhere


@dataclass
class Arm:
    """One (point, method) of an experiment at a scale."""

    point: Point
    method: Method
    rounds: int
    seeds: tuple[int, ...]
    eval_every: int
    settings: dict[str, Any]  # point, scale and method settings merged (method last)
    scoped: tuple[str, ...]  # keys that came from the method (must apply)
    backbones: tuple[str, ...] = ()
    backbone_note: str = ""  # "stand-in", "fallback: ...", "originals"
    data: DataRequest | None = None
    data_note: str = ""
    unavailable: str = ""  # why it cannot run ("" = it runs)
    prepared: Prepared | None = None
    cells: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.point.key()} / {self.method.label}"


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@cache
def _has_field(algorithm: str, name: str) -> bool:
    from fedheads.run.settings import config_class

    cls = config_class(algorithm)
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)}


def missing_requirement(requires: tuple[str, ...]) -> str:
    """"" when every requirement is met, else why not ("not available yet: <what>", or for
    "command:fedheads feddra" the one line "fedheads feddra not available in this build")."""
    for req in requires:
        kind, _, what = req.partition(":")
        if kind == "module" and not _module_exists(what):
            return f"not available yet: needs {what}"
        if kind == "field":
            alg, _, name = what.partition(".")
            if not _has_field(alg, name):
                return f"not available yet: needs a {alg} option '{name}'"
        if kind == "command" and what == "fedheads feddra":
            from pipelines.cells import FEDDRA_MISSING, feddra_available

            if not feddra_available():
                return FEDDRA_MISSING
        if kind == "missing":
            return f"not available yet: needs {what}"
    return ""


@lru_cache(maxsize=4)
def _available_backbones(weights_dir: str | None) -> dict[str, tuple[bool, str]]:
    from embedcache.backbones import list_backbones

    return {b.name: (bool(b.available), str(b.reason)) for b in list_backbones(weights_dir)}


def backbone_problem(name: str, weights_dir: str | None = None) -> str:
    """"" when `name` can be created here (as far as the registry can tell), else why not."""
    if name.startswith("missing:"):
        return f"no embedcache backbone for {name[8:]}"
    base = name.split("@", 1)[0]
    reg = _available_backbones(weights_dir)
    if base in reg:
        ok, why = reg[base]
        return "" if ok else f"{base}: {why}"
    family = base.split(":", 1)[0]
    if family in ("timm", "tv"):
        return ""  # resolved (or refused with the reason) when extraction creates it
    if family in reg:  # e.g. efficientnet-lite0:160
        ok, why = reg[family]
        return "" if ok else f"{family}: {why}"
    return f"{base}: not a registered backbone"


def choose_backbones(bs: BackboneSet, originals: bool, mapping: dict[str, str] | None = None,
                     weights_dir: str | None = None) -> tuple[tuple[str, ...], str, str]:
    """(names, note, problem): the originals with --originals, else the stand-ins, else the fallback;
    `mapping` (--backbone NAME=OTHER) renames any of them first."""
    mapping = mapping or {}
    ren = lambda names: tuple(mapping.get(n, n) for n in names)  # noqa: E731
    problems = lambda names: [p for p in (backbone_problem(n, weights_dir) for n in names) if p]  # noqa: E731

    def chosen(names: tuple[str, ...], note: str) -> tuple[tuple[str, ...], str, str]:
        swapped = [f"{mapping[n]} in place of {n}" for n in names if mapping.get(n, n) != n]
        return ren(names), (f"--backbone {', '.join(swapped)} ({note})" if swapped else note), ""

    if originals:
        names, note, _ = chosen(bs.paper, "the paper's backbones")
        return names, note, "; ".join(problems(names))
    if not bs.standin:
        return (), "", f"no offline stand-in for {bs.label}: {bs.note}"
    probs = problems(ren(bs.standin))
    if not probs:
        return chosen(bs.standin, f"stand-ins for {bs.label}")
    asked = [f"--backbone {n}={mapping[n]}" for n in bs.standin if n in mapping]
    if asked:  # a backbone the user named is never replaced by the fallback behind their back
        return (), "", f"{'; '.join(probs)} (asked for by {', '.join(asked)})"
    if bs.fallback and not problems(ren(bs.fallback)):
        return chosen(bs.fallback, f"fallback ({probs[0]})")
    return (), "", "; ".join(probs)


def check_backbone_map(exps: Sequence[Experiment], mapping: Sequence[tuple[str, str]],
                       weights_dir: str | None = None) -> None:
    """Each --backbone NAME=OTHER replaces a backbone the selected experiments name, with a
    backbone the registry knows (one line otherwise, with the closest names): an unknown OTHER
    would leave every arm to its fallback, a NAME no experiment names would change nothing."""
    named = {n for e in exps for p in e.points for n in (*p.backbones.paper, *p.backbones.standin, *p.backbones.fallback)}
    for name, other in mapping:
        flag = f"--backbone {name}={other}"
        if name not in named:
            raise UserError(f"{flag}: no selected experiment names backbone {name!r}{did_you_mean(name, sorted(named))} "
                            f"(they name: {', '.join(sorted(named))})")
        if backbone_problem(other, weights_dir).endswith("not a registered backbone"):
            known = sorted(_available_backbones(weights_dir))
            raise UserError(f"{flag}: unknown backbone {other!r}{did_you_mean(other.split('@', 1)[0], known)} "
                            f"(registered: {', '.join(known)}; or timm:MODEL, tv:MODEL, ckpt:PATH)")


def data_request(point: Point, ctx: RunContext) -> tuple[DataRequest | None, str]:
    """The partition of a point in embedcache terms, or None with the reason."""
    r = point.data
    sources = dict(ctx.sources)
    spec, original, why = datasets.resolve_source(r.dataset, sources)
    if spec is None:
        return None, why
    ds = datasets.DATASETS[r.dataset]
    if not original and r.standin_domains is not None:
        pairs: list[tuple[str, str | None]] = [(d, d) for d in r.standin_domains]  # () pools every domain
    else:
        from embedcache.sources import open_source

        avail = list(open_source(spec).domains()) if original else []
        pairs = datasets.map_domains(r.dataset, r.domains, avail, original)
        if not original and len(ds.domains) == 1:
            pairs = []  # a one-domain data set's stand-in pools every stand-in domain
    doms = [s for _, s in pairs if s is not None]
    missing = [d for d, s in pairs if s is None]
    if pairs and not doms:
        return None, f"no stand-in for {', '.join(d for d, _ in pairs)} of {ds.paper_name}"
    fields: dict[str, Any] = {"scheme": r.scheme, "domains": tuple(doms)}
    for k in ("train_per_class", "test_per_class", "clients", "alpha", "train_fraction", "min_samples"):
        if getattr(r, k) is not None:
            fields[k] = getattr(r, k)
    note = why + (f"; no counterpart for {', '.join(missing)}" if missing else "")
    return DataRequest(spec, tuple(sorted(fields.items())), r.seed, r.dataset, original, r.train_total,
                       r.max_train_fraction, tuple((d, s) for d, s in pairs if s is not None)), note


def _apply_scale_data(req: DataRequest, cap: int | None) -> DataRequest:
    """The scale's cap on test images per class, for the schemes that take one."""
    fields = dict(req.recipe)
    if cap is None or fields["scheme"] == "label-shift":
        return req
    old = fields.get("test_per_class")
    fields["test_per_class"] = cap if old is None else min(old, cap)
    return dataclasses.replace(req, recipe=tuple(sorted(fields.items())))


def arms(exp: Experiment, ctx: RunContext) -> list[Arm]:
    """Every (point, method) of `exp` at `ctx.scale`, with what it needs or why it cannot run."""
    sc = exp.scale(ctx.scale)
    _available_backbones.cache_clear()  # backbones registered since the last plan count
    out = []
    for p in exp.points:
        if ctx.scale not in p.scales:
            continue
        for m in exp.methods:
            if (p.methods is not None and m.label not in p.methods) or ctx.scale not in m.scales:
                continue
            rounds = sc.rounds or dict(p.rounds).get(m.label) or m.paper_rounds or exp.rounds
            settings = {**dict(sc.settings), **dict(p.settings), **dict(m.settings)}
            if "dp" in dict(m.settings):
                settings["dp"] = merged_dp(dict(p.settings).get("dp", dict(sc.settings).get("dp")), dict(m.settings)["dp"])
            arm = Arm(p, m, rounds, sc.seeds or exp.seeds, sc.eval_every, settings, tuple(dict(m.settings)))
            arm.unavailable = missing_requirement(m.requires) or missing_requirement(p.requires)
            if not arm.unavailable:
                arm.backbones, arm.backbone_note, prob = choose_backbones(p.backbones, ctx.originals,
                                                                          dict(ctx.backbone_map), ctx.weights_dir)
                arm.unavailable = f"backbones unavailable: {prob}" if prob else ""
                if not arm.unavailable:
                    _fill_cut(arm)  # may say why the backbone cannot fine-tune from the cache
            if not arm.unavailable:
                req, arm.data_note = data_request(p, ctx)
                arm.data = _apply_scale_data(req, sc.test_per_class) if req else None
                arm.unavailable = "" if req else f"data unavailable: {arm.data_note}"
            out.append(arm)
    return out


def merged_dp(outer: Any, method: Any) -> tuple[tuple[str, Any], ...]:
    """A method's mechanism fields over its point's (or scale's): FedPFT's ("mode", "local") keeps
    the point's epsilon. Pairs in the point's order, the method's new fields after."""
    return tuple({**dict(outer or ()), **dict(method)}.items())


def _fill_cut(arm: Arm) -> None:
    """'{cut}' in a setting (e.g. trainable=after:{cut}) = the backbone's last cut point but one:
    its last stage and the head train, everything before is read from the cache."""
    for k, v in list(arm.settings.items()):
        if isinstance(v, str) and "{cut}" in v and arm.backbones:
            from embedcache.backbones import list_backbones

            base = arm.backbones[0].split("@", 1)[0]
            cuts = next((tuple(b.cut_points or ()) for b in list_backbones() if b.name == base), ())
            if not cuts:  # not declared at registration: ask the model itself
                from embedcache.backbones import create_backbone

                try:
                    bb = create_backbone(base)
                    if not callable(getattr(bb, "trainable", None)):  # a duck-typed plugin backbone
                        arm.unavailable = f"{base}: cannot be fine-tuned (it has no trainable()) ({k}={v})"
                        return
                    cuts = tuple(bb.trainable().cut_points())
                except UserError:
                    cuts = ()
            if len(cuts) < 2:
                arm.unavailable = f"{base}: no cut point to fine-tune from the cache ({k}={v})"
                return
            arm.settings[k] = v.replace("{cut}", cuts[-2])


def extra_backbones(arm: Arm) -> list[str]:
    """What the store must hold: the backbones, plus B@CUT maps for cache-first fine-tuning."""
    names = list(arm.backbones)
    if arm.method.kind == "feddra":  # `fedheads feddra` encodes live when given no token store
        return []
    if arm.method.kind == "finetune":
        names = names[:1]
        trainable = str(arm.settings.get("trainable", "all"))
        if trainable.startswith("after:") and not arm.settings.get("live_prefix"):
            names.append(f"{names[0]}@{trainable.split(':', 1)[1]}")
    return names


def cell_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:24]


def cells(arm: Arm, ctx: RunContext) -> list[dict[str, Any]]:
    """One cell per seed: {"hash", "config" (hashed), "paths" (not hashed)}."""
    if arm.prepared is None:
        raise UserError(f"{arm.label}: data not prepared")
    p, m = arm.prepared, arm.method
    options = {"rounds": arm.rounds, "eval_every": arm.eval_every, "device": ctx.device, "fraction": 1.0}
    options.update({k: v for k, v in arm.settings.items() if k in OPTION_KEYS})
    settings = {k: v for k, v in arm.settings.items() if k not in OPTION_KEYS}
    base = {"format": CELL_FORMAT, "kind": m.kind, "algorithm": m.algorithm, "manifest_hash": p.manifest_hash,
            "backbones": list(arm.backbones), "features": p.features, "options": options,
            "settings": {"method": {k: v for k, v in settings.items() if k in arm.scoped},
                         "common": {k: v for k, v in settings.items() if k not in arm.scoped}},
            "threads": ctx.threads}
    if m.kind == "head" and m.algorithm in RESEEDED and float(options["fraction"]) >= 1.0:
        base["client_seeds"] = "global-id"
    if m.kind == "feddra":  # what the preset sets is part of the cell: a preset whose meaning changes
        from fedheads.alignment.runner import BASELINES  # (fedavg became one-stage) is never served stale

        base["preset"] = BASELINES.get(m.algorithm)
    out = []
    for seed in arm.seeds:
        cfg = {**base, "seed": int(seed)}
        out.append({"hash": cell_hash(cfg), "config": cfg,
                    "paths": {"manifest": str(p.manifest_path), "store": p.store and str(p.store),
                              "weights_dir": ctx.weights_dir},
                    "labels": {"point": arm.point.key(), "method": m.label, "seed": int(seed)}})
    return out
