"""Partitioners: pure functions from a source index and a seed to a Manifest.

Schemes (FedPCL, Tan et al. NeurIPS 2022, Section 5.1 and Appendix A.1; FedNCM, Legate et al.
NeurIPS 2023, Section 4):
- feature shift (Table 8): one client per domain, N training images per class (paper: 10), the
  rest of the domain (or T per class) as the client's test set;
- label shift (Table 9): M clients drawn from one domain (or all domains pooled), class
  proportions over clients from a per-class Dirichlet(alpha) as in the FedPCL code; each client's
  samples are split per class into train (fraction f, paper: ~10%) and test;
- feature & label shift (Table 10): clients differ in domain (round-robin over domains) and in
  label mix: client i draws class proportions q_i ~ Dirichlet(alpha) and N*C training images by
  those proportions from its domain; its test set is the rest of its domain for the classes it
  has, shared evenly between the domain's clients;
- FedNCM: `--preset fedncm` = label shift over all domains pooled, 100 clients, alpha 0.1.

Everything random comes from one numpy Generator(seed) consumed in a fixed order, so the same
arguments give the same manifest, byte for byte. What had to be handled (a class a client lacks,
a client with too few samples, an alpha that cannot be met) is recorded in `manifest.report`."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from embedcache.errors import UserError
from embedcache.manifest import Client, Manifest, Sample

SCHEMES = ("feature-shift", "label-shift", "feature-label-shift")
PRESETS = {"fedncm": {"scheme": "label-shift", "clients": 100, "alpha": 0.1, "train_fraction": 0.8}}
REDRAWS = 10  # Dirichlet re-draws when a client comes out below min_samples


@dataclass(frozen=True)
class Recipe:
    """All partition arguments (recorded in the manifest)."""

    scheme: str
    train_per_class: int = 10  # feature(-label) shift: N training images per class (FedPCL: 10)
    test_per_class: int | None = None  # None: the rest of the domain
    clients: int | None = None  # label shift: M (default 5); feature-label shift: default one per domain
    alpha: float = 1.0  # Dirichlet concentration
    domains: tuple[str, ...] = ()  # restrict to these domains (label shift: one = --domain)
    train_fraction: float = 0.1  # label shift: share of each client's samples used for training
    min_samples: int = 2  # fewest samples (train + test, before the split) a Dirichlet client should get

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["domains"] = list(self.domains)
        return d


def _by_domain_class(index: Sequence[tuple[str, str, int]]) -> dict[str, dict[int, list[str]]]:
    out: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for dom, loc, lab in index:
        out[dom][lab].append(loc)
    return {d: {c: sorted(v) for c, v in sorted(cl.items())} for d, cl in sorted(out.items())}


def _samples(locs: Sequence[str], label: int) -> list[Sample]:
    return [Sample(loc, loc, int(label)) for loc in locs]


def _missing_report(clients: Sequence[Client], classes: Sequence[str], report: dict[str, Any]) -> None:
    missing = {}
    for c in clients:
        have = {s.label for s in c.train}
        lack = [classes[k] for k in range(len(classes)) if k not in have]
        if lack:
            missing[c.name] = lack
    if missing:
        report["missing_classes"] = missing


def feature_shift(groups: dict[str, dict[int, list[str]]], classes: Sequence[str], r: Recipe,
                  rng: np.random.Generator, report: dict[str, Any]) -> list[Client]:
    clients = []
    short: list[str] = []
    for i, (dom, by_class) in enumerate(groups.items()):
        train, test = [], []
        for lab in range(len(classes)):
            locs = by_class.get(lab, [])
            perm = [locs[j] for j in rng.permutation(len(locs))]
            n_tr = min(r.train_per_class, len(perm))
            if n_tr < r.train_per_class:
                short.append(f"{dom}/{classes[lab]}: {len(perm)} images for {r.train_per_class} training")
            rest = perm[n_tr:]
            if r.test_per_class is not None:
                rest = rest[: r.test_per_class]
            train += _samples(perm[:n_tr], lab)
            test += _samples(rest, lab)
        clients.append(Client(f"c{i:02d}-{dom}", dom, tuple(train), tuple(test)))
    if short:
        report["short_classes"] = short
    return clients


def dirichlet_split(by_class: dict[int, list[str]], m: int, alpha: float, rng: np.random.Generator,
                    min_samples: int, report: dict[str, Any]) -> list[list[tuple[str, int]]]:
    """Per-class Dirichlet(alpha) shares over m clients (Hsu et al. 2019, as in the FedPCL and
    FedNCM code); re-drawn up to REDRAWS times while a client has fewer than min_samples."""
    total = sum(len(v) for v in by_class.values())
    if total < m * max(min_samples, 1):
        report.setdefault("warnings", []).append(
            f"alpha={alpha}, clients={m}: only {total} samples, so some clients get fewer than "
            f"{max(min_samples, 1)} (cannot be satisfied)")
    parts: list[list[tuple[str, int]]] = []
    for attempt in range(REDRAWS + 1):
        parts = [[] for _ in range(m)]
        for lab, locs in by_class.items():
            perm = [locs[j] for j in rng.permutation(len(locs))]
            p = rng.dirichlet(np.full(m, alpha))
            cuts = (np.cumsum(p) * len(perm)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(np.arange(len(perm)), cuts)):
                parts[k] += [(perm[j], lab) for j in chunk]
        smallest = min(len(p) for p in parts)
        if smallest >= min_samples:
            if attempt:
                report["dirichlet_redraws"] = attempt
            break
    else:
        report.setdefault("warnings", []).append(
            f"after {REDRAWS} Dirichlet re-draws the smallest client still has {smallest} samples "
            f"(< min_samples={min_samples}); kept and reported")
    return parts


def _train_test(items: list[tuple[str, int]], frac: float, rng: np.random.Generator) -> tuple[list[Sample], list[Sample]]:
    """Per class: round(frac*n) training samples (at least 1 when the class has 2 or more)."""
    by: dict[int, list[str]] = defaultdict(list)
    for loc, lab in items:
        by[lab].append(loc)
    train, test = [], []
    for lab in sorted(by):
        locs = sorted(by[lab])
        perm = [locs[j] for j in rng.permutation(len(locs))]
        n = int(round(frac * len(perm)))
        n = max(n, 1) if len(perm) >= 2 else len(perm)
        train += _samples(perm[:n], lab)
        test += _samples(perm[n:], lab)
    return train, test


def label_shift(groups: dict[str, dict[int, list[str]]], classes: Sequence[str], r: Recipe,
                rng: np.random.Generator, report: dict[str, Any]) -> list[Client]:
    pooled: dict[int, list[str]] = defaultdict(list)
    for by_class in groups.values():
        for lab, locs in by_class.items():
            pooled[lab] += locs
    pooled = {k: sorted(v) for k, v in sorted(pooled.items())}
    dom = next(iter(groups)) if len(groups) == 1 else "pooled"
    m = r.clients or 5
    parts = dirichlet_split(pooled, m, r.alpha, rng, r.min_samples, report)
    clients = []
    for i, items in enumerate(parts):
        train, test = _train_test(items, r.train_fraction, rng)
        width = max(2, len(str(m - 1)))
        clients.append(Client(f"c{i:0{width}d}-{dom}", dom, tuple(train), tuple(test)))
    return clients


def feature_label_shift(groups: dict[str, dict[int, list[str]]], classes: Sequence[str], r: Recipe,
                        rng: np.random.Generator, report: dict[str, Any]) -> list[Client]:
    doms = list(groups)
    m = r.clients or len(doms)
    C = len(classes)
    pools = {d: {lab: [locs[j] for j in rng.permutation(len(locs))] for lab, locs in groups[d].items()} for d in doms}
    plan = []
    for i in range(m):
        d = doms[i % len(doms)]
        q = rng.dirichlet(np.full(C, r.alpha))
        want = rng.multinomial(r.train_per_class * C, q)
        train = []
        for lab in range(C):
            avail = pools[d].get(lab, [])
            take = min(int(want[lab]), len(avail))
            train += _samples(avail[:take], lab)
            pools[d][lab] = avail[take:]
        plan.append((d, train))
    # test: the rest of each domain, per class shared evenly among the domain's clients having it
    tests: list[list[Sample]] = [[] for _ in range(m)]
    for d in doms:
        for lab, rest in pools[d].items():
            owners = [i for i, (dd, tr) in enumerate(plan) if dd == d and any(s.label == lab for s in tr)]
            if r.test_per_class is not None:
                rest = rest[: r.test_per_class * max(len(owners), 1)]
            for j, loc in enumerate(rest):
                if owners:
                    tests[owners[j % len(owners)]] += _samples([loc], lab)
    return [Client(f"c{i:02d}-{d}", d, tuple(tr), tuple(tests[i])) for i, (d, tr) in enumerate(plan)]


_SCHEME_FN = {"feature-shift": feature_shift, "label-shift": label_shift, "feature-label-shift": feature_label_shift}


def partition(source: Any, recipe: Recipe, seed: int) -> Manifest:
    """Build the manifest of `recipe` over `source` (an ImageSource, contract 2)."""
    if recipe.scheme not in SCHEMES:
        raise UserError(f"--scheme {recipe.scheme!r}: must be one of {', '.join(SCHEMES)}")
    if recipe.alpha <= 0:
        raise UserError(f"--alpha {recipe.alpha}: must be > 0")
    if (recipe.clients is not None and recipe.clients < 1) or recipe.train_per_class < 1:
        raise UserError("--clients and --train-per-class must be >= 1")
    if recipe.test_per_class is not None and recipe.test_per_class < 0:
        raise UserError(f"--test-per-class {recipe.test_per_class}: must be >= 0")
    if recipe.min_samples < 0:
        raise UserError(f"--min-samples {recipe.min_samples}: must be >= 0")
    if not 0.0 < recipe.train_fraction < 1.0:
        raise UserError(f"--train-fraction {recipe.train_fraction}: must be in (0, 1)")
    classes = list(source.classes())
    groups = _by_domain_class(source.index())
    if recipe.domains:
        for d in recipe.domains:
            if d not in groups:
                raise UserError(f"domain {d!r}: not in {source.spec} (domains: {', '.join(groups)})")
        groups = {d: groups[d] for d in recipe.domains}
    report: dict[str, Any] = {}
    rng = np.random.default_rng(seed)
    clients = _SCHEME_FN[recipe.scheme](groups, classes, recipe, rng, report)
    empty = [c.name for c in clients if not c.train]
    if empty:
        report.setdefault("warnings", []).append(
            f"dropped {len(empty)} client(s) with no training sample (e.g. {empty[0]}); see report.dropped_clients")
        report["dropped_clients"] = empty
        clients = [c for c in clients if c.train]
    if not clients:
        raise UserError(f"{source.spec}: the recipe leaves no client with training samples")
    few = {c.name: len(c.train) for c in clients if len(c.train) < recipe.min_samples}
    if few:
        report["small_clients"] = few
    _missing_report(clients, classes, report)
    report["sizes"] = {c.name: [len(c.train), len(c.test)] for c in clients}
    return Manifest(source=source.spec, classes=tuple(classes), clients=tuple(clients),
                    recipe=recipe.as_dict(), seed=int(seed), report=report).validate()
