"""Experiments as data: the typed description of one table or figure of a paper.

An `Experiment` names its data (a `DataRecipe` per grid point, in the paper's terms), its
backbones (the paper's originals and the offline stand-ins), its methods with their settings,
seeds, rounds, the grid axes, the published values with their provenance, and how the report
lays the table out. `pipelines.plan` turns it into independent cells (point x method x seed) at
a chosen scale; nothing here runs anything.

Scales: `paper` is the paper's own protocol (clients, splits, rounds, seeds, hyper-parameters;
the models are evaluated every 10 rounds and at the last, which is what the tables report, except
where an experiment plots accuracy against rounds); `ci` shrinks rounds, seeds, test sets and grids
so that one experiment finishes in minutes on 2 CPU cores; `smoke` runs in seconds (a plumbing
check, not a result).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from embedcache.errors import UserError

SCALES = ("smoke", "ci", "paper")
KINDS = ("head", "finetune", "feddra")
Settings = tuple[tuple[str, Any], ...]  # ordered (field, value) pairs, hashable


@dataclass(frozen=True)
class Dataset:
    """A data set of the papers, how to point at the real one, and what stands in for it offline."""

    key: str  # short name used on the command line (--source KEY=SPEC)
    paper_name: str  # as printed in the papers ("Digit-5")
    domains: tuple[str, ...]  # the paper's domains in its table order ("MNIST", "SVHN", ...)
    layout: str  # the folder layout of a real copy (data_manifests/README.md), one line
    aliases: tuple[tuple[str, tuple[str, ...]], ...]  # paper domain -> folder names it may have
    classes: tuple[str, ...] = ()  # the classes the papers use ((): whatever the copy has)
    standin: str = ""  # offline source spec ("builtin:digits", "imagefolder:{assets}/..."); "" = none
    standin_domains: tuple[tuple[str, str | None], ...] = ()  # paper domain -> stand-in domain (None: none)
    standin_note: str = ""  # what differs, one sentence (used in deviation sentences)


@dataclass(frozen=True)
class DataRecipe:
    """A partition in the paper's terms (embedcache.partitioning.Recipe with paper domain names)."""

    dataset: str  # Dataset.key
    scheme: str  # feature-shift | label-shift | feature-label-shift
    domains: tuple[str, ...] = ()  # paper domain names; () = every domain (pooled for label shift)
    train_per_class: int | None = None
    test_per_class: int | None = None  # cap on test images per class (None: the rest of the domain)
    clients: int | None = None
    alpha: float | None = None
    train_fraction: float | None = None
    min_samples: int | None = None
    train_total: int | None = None  # label shift: training samples over all clients (Table 9 sizes);
    # resolved to train_fraction = train_total / |domain| (at most max_train_fraction) for the copy used
    max_train_fraction: float = 0.5
    standin_domains: tuple[str, ...] | None = None  # stand-in domains when they differ from the mapped ones
    seed: int = 0  # partition seed: one fixed split, training seeds vary (see docs/contracts.md 9)
    note: str = ""  # how this reads the paper's setting, when the paper is not explicit


@dataclass(frozen=True)
class BackboneSet:
    """Backbones concatenated in order (FedPCL Eq. 1-2) or the one fine-tuned (FedNCM)."""

    label: str  # as the paper names it ("3 x ResNet18 (Quickdraw, Aircraft, Birds)")
    paper: tuple[str, ...]  # the originals, as embedcache names when they have one
    standin: tuple[str, ...]  # offline stand-ins (empty: none)
    fallback: tuple[str, ...] = ()  # used when a stand-in is unavailable (fresh machine: no ../shared)
    note: str = ""  # how the stand-ins differ, one sentence


@dataclass(frozen=True)
class Method:
    """One row of the paper's table: an algorithm with its settings."""

    label: str  # as printed ("FedAvg", "Ours", "FedNCM+FT")
    algorithm: str  # fedheads algorithm (head) | stage-1 head fedncm/lp/random (finetune) | preset (feddra)
    kind: str = "head"  # head (on the store) | finetune (fedheads finetune) | feddra
    settings: Settings = ()  # algorithm config fields (head: --set; finetune: FinetuneOptions / ft.* fields)
    paper_rounds: int | None = None  # the paper's (or its authors' scripts') rounds for this method
    scales: tuple[str, ...] = SCALES  # scales at which it runs
    requires: tuple[str, ...] = ()  # "module:M" | "field:ALG.FIELD" | "command:fedheads feddra" | "missing:<what>"
    note: str = ""  # code-vs-paper remark, used in deviation sentences


@dataclass(frozen=True)
class Point:
    """One point of the grid: its coordinates (as the paper labels them) and what they set."""

    coords: tuple[tuple[str, Any], ...]  # (("BB", "m"),) / (("alpha", 0.5),) / (("dataset", "Office-10"),)
    data: DataRecipe
    backbones: BackboneSet
    methods: tuple[str, ...] | None = None  # labels of the methods run here (None: all)
    settings: Settings = ()  # settings for every method at this point (e.g. prototype noise)
    scales: tuple[str, ...] = SCALES  # scales at which this point runs (grids shrink at ci/smoke)
    requires: tuple[str, ...] = ()  # as Method.requires ("missing:<what>" is never available)
    rounds: tuple[tuple[str, int], ...] = ()  # method label -> the paper's rounds at this point

    def key(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.coords) or "-"

    def coord(self, name: str) -> Any:
        return dict(self.coords).get(name)


@dataclass(frozen=True)
class Published:
    """One published number and where it is printed."""

    method: str  # Method.label
    metric: str  # a metric of pipelines.metrics ("acc", "domain:MNIST", "worst_10", ...)
    value: float | None  # None: not printed or not reliably readable (see note)
    std: float | None = None
    coords: tuple[tuple[str, Any], ...] = ()  # the point (Point.coords) it belongs to
    where: str = ""  # table/figure when it differs from the experiment's (e.g. "Table 11")
    row: str = ""  # row label as printed ("" = method label)
    column: str = ""  # column label as printed ("" = the metric's header)
    note: str = ""  # e.g. "garbled in the PDF text; not compared"


CLAIM_DIRECTIONS = ("higher", "lower")


@dataclass(frozen=True)
class Claim:
    """A claim of the paper, checked on our results ("FedPCL above every baseline", "by about 15 %").

    The margin is `best` minus its strongest rival ("higher") or the strongest rival minus `best`
    ("lower", e.g. Variance: the smaller, the fairer), in the metric's units (pp for accuracies);
    the claim holds when the margin is positive and, where the paper states a size, inside
    `magnitude`. It is not testable at smoke scale or with fewer than 2 seeds (no spread)."""

    text: str
    best: str  # Method.label expected on top (or at the bottom, direction "lower")
    over: tuple[str, ...] = ()  # labels it should beat (() = every other method at the point)
    where: tuple[tuple[str, Any], ...] = ()  # coordinate filter (() = every point)
    metric: str = "acc"
    against: tuple[tuple[str, Any], ...] = ()  # compare `best` here with `best` at this other point instead
    direction: str = "higher"  # "higher" | "lower": which way `best` beats its rivals
    magnitude: tuple[float, float] | None = None  # the stated margin as a range (lo, hi); None: the sign only
    quote: str = ""  # the paper's words for the magnitude, with where they are printed


@dataclass(frozen=True)
class ScaleSpec:
    """What a scale changes (None: keep the paper's)."""

    rounds: int | None = None  # every method's rounds
    seeds: tuple[int, ...] | None = None
    test_per_class: int | None = None  # cap on test images per class and client
    eval_every: int = 1  # evaluate every k rounds (the last round always)
    settings: Settings = ()  # extra settings for every method (e.g. cache-first fine-tuning)


SMOKE = ScaleSpec(rounds=2, seeds=(0,), test_per_class=5, eval_every=1)
# cache-first fine-tuning: the backbone's last stage and the head train on the stored maps of its last
# cut point but one ('{cut}', filled per backbone by pipelines.plan); everything before is read from the cache
CACHE_FIRST: Settings = (("trainable", "after:{cut}"),)
CI = ScaleSpec(rounds=20, seeds=(0, 1, 2), test_per_class=30, eval_every=5)
# The paper's protocol. Tables read the last round, which is always evaluated, and evaluating
# changes no weight (tests/test_engine_equivalence.py, every algorithm), so a table's numbers do
# not depend on eval_every; evaluating every round was 69 % of a FedPCL paper-scale sweep
# (Table 14). Experiments whose figure is a curve against rounds (FedNCM Figure 1) set their own.
PAPER = ScaleSpec(eval_every=10)


@dataclass(frozen=True)
class Layout:
    """The paper's table: which coordinates make the rows and the columns of the report.

    Coordinate names are the points' coordinates plus "method" and "metric"."""

    rows: tuple[str, ...] = ("method",)
    columns: tuple[str, ...] = ("metric",)
    metrics: tuple[str, ...] = ("acc",)
    figure: str = ""  # "" | "vs:<coord>" (lines over a coordinate) | "curves" | "fairness" | "grid:<x>,<y>"


@dataclass(frozen=True)
class Experiment:
    name: str  # registry key, e.g. "fedpcl-table2"
    title: str
    paper: str  # "FedPCL" | "FedNCM" | "FedDRA" (pipelines.registry.PAPERS gives the citation)
    source: str  # "Table 2" / "Figure 2 (a)"
    summary: str  # what the paper measures here, one or two sentences
    methods: tuple[Method, ...]
    points: tuple[Point, ...]
    axes: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # grid axes and the paper's values
    rounds: int = 100  # the paper's rounds (methods may override with paper_rounds)
    seeds: tuple[int, ...] = (0, 1, 2)  # the papers: mean (std) over 3 runs
    published: tuple[Published, ...] = ()
    claims: tuple[Claim, ...] = ()
    layout: Layout = field(default_factory=Layout)
    scales: tuple[tuple[str, ScaleSpec], ...] = (("smoke", SMOKE), ("ci", CI), ("paper", PAPER))
    notes: tuple[str, ...] = ()  # protocol choices and readings, shown in the report

    def scale(self, name: str) -> ScaleSpec:
        if name not in SCALES:
            raise UserError(f"--scale {name!r}: use one of {', '.join(SCALES)}")
        return dict(self.scales).get(name, ScaleSpec())

    def method(self, label: str) -> Method:
        for m in self.methods:
            if m.label == label:
                return m
        raise UserError(f"{self.name}: no method {label!r}")

    def check(self) -> Experiment:
        """Internal consistency (run by the registry test): labels unique, references resolve."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.name):
            raise UserError(f"experiment {self.name!r}: use lower-case letters, digits and '-'")
        labels = [m.label for m in self.methods]
        if len(set(labels)) != len(labels):
            raise UserError(f"{self.name}: method labels repeat")
        for m in self.methods:
            if m.kind not in KINDS:
                raise UserError(f"{self.name}/{m.label}: kind {m.kind!r} not in {KINDS}")
        keys = [p.coords for p in self.points]
        if len(set(keys)) != len(keys):
            raise UserError(f"{self.name}: two points share coordinates")
        for p in self.points:
            for lab in p.methods or ():
                self.method(lab)
        for cl in self.claims:
            if cl.direction not in CLAIM_DIRECTIONS:
                raise UserError(f"{self.name}: claim {cl.text!r}: direction {cl.direction!r} not in {CLAIM_DIRECTIONS}")
            if cl.magnitude is not None and not cl.magnitude[0] <= cl.magnitude[1]:
                raise UserError(f"{self.name}: claim {cl.text!r}: magnitude {cl.magnitude} is not (lo, hi)")
        for pub in self.published:
            self.method(pub.method)
            if pub.coords not in keys:
                raise UserError(f"{self.name}: published {pub.method}/{pub.metric} at {pub.coords}: no such point")
        return self


def parse_cell(text: str) -> tuple[float | None, float | None]:
    """"82.75(0.40)" / "87.2 ± 0.2" / "34.2" / "?" -> (value, std); "?" = not reliably readable."""
    t = text.strip().replace(",", "")
    if t in ("?", "-", ""):
        return None, None
    m = re.fullmatch(r"(-?[\d.]+(?:e-?\d+)?)\s*(?:\(([\d.]+)\)|±\s*([\d.]+))?", t)
    if not m:
        raise ValueError(f"cannot parse published cell {text!r}")
    std = m.group(2) or m.group(3)
    return float(m.group(1)), (float(std) if std is not None else None)


def published_rows(text: str, metrics: tuple[str, ...], coords_of: dict[str, tuple[tuple[str, Any], ...]] | None = None,
                   **common: Any) -> tuple[Published, ...]:
    """Published values from table rows copied from the paper's text, one per line:
    `<row key> | <method label> | cell cell ...` (row key selects coords via `coords_of`; "" = ()).
    Keeping the printed strings makes the transcription easy to check against the paper."""
    out = []
    for line in text.strip().splitlines():
        key, method, cells = (s.strip() for s in line.split("|"))
        vals = cells.split()
        if len(vals) != len(metrics):
            raise ValueError(f"{line!r}: {len(vals)} cells for {len(metrics)} metrics")
        for metric, cell in zip(metrics, vals):
            v, s = parse_cell(cell)
            note = common.get("note", "") if v is not None else (common.get("missing_note") or "not readable")
            kw = {k: v2 for k, v2 in common.items() if k not in ("note", "missing_note")}
            out.append(Published(method=method, metric=metric, value=v, std=s,
                                 coords=(coords_of or {}).get(key, ()), note=note, **kw))
    return tuple(out)
