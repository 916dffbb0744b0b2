"""Partitioners: pure functions from a source index and a seed to a Manifest.

Schemes (FedPCL, Tan et al. NeurIPS 2022, Section 5.1 and Appendix A.1; FedNCM, Legate et al.
NeurIPS 2023, Section 4):
- feature shift (Table 8): one client per domain, N training images per class (paper: 10), the
  rest of the domain (or T per class) as the client's test set; or, with a train fraction f,
  round(f*n) of each class's n images for training (FedDRA's one-client-per-domain variant);
- label shift (Table 9): M clients drawn from one domain (or all domains pooled), class
  proportions over clients from a per-class Dirichlet(alpha) as in the FedPCL code; each client's
  samples are split per class into train (fraction f, paper: ~10%) and test;
- feature & label shift (Table 10): clients differ in domain (round-robin over domains) and in
  label mix: client i draws class proportions q_i ~ Dirichlet(alpha) and N*C training images by
  those proportions from its domain; its test set is the rest of its domain for the classes it
  has, shared evenly between the domain's clients;
- label shift with a real federation's client sizes (`--client-sizes NAME|CSV`,
  embedcache.federation_shapes, e.g. iNaturalist-Users-120K: 9,275 clients, median 2 training
  images): client i gets exactly n_i training samples, n_i the shape's sizes in a seeded order
  (M = --clients sizes at the shape's quantiles; by default the shape's own, exactly), drawn from
  the pooled classes by its own proportions q_i ~ Dirichlet(alpha * C * p), p the pool's class
  frequencies (Hsu et al. 2019, Section 3);
  its test set is the rest of the pool for the classes it has, shared evenly between the clients
  having each class (as feature & label shift does);
- FedNCM: `--preset fedncm` = label shift over all domains pooled, 100 clients, alpha 0.1;
- FedDRA (federated distributionally robust vision-language alignment; the offline setting of the
  FedDRA reading notes, section 3): `--preset feddra` = label shift over amazon + caltech10
  pooled, 5 clients, alpha 1, 80/20 train/test per client, on a source with texts.

Sources with texts (a `captioned:` source, an image folder with captions.tsv; contract 2a) give
every sample its text (Sample.text) and the recipe records where they came from ("captions").

Everything random comes from one numpy Generator(seed) consumed in a fixed order, so the same
arguments on the same files give the same manifest, byte for byte. Each sample's fingerprint
(ImageSource.fingerprint, contract 2) is recorded so later changes to the images are caught.
What had to be handled (a class a client lacks, a class with fewer images than asked for, a
client with too few samples or none to test on, an alpha that cannot be met) is recorded in
`manifest.report`. An option the scheme does not use is refused, never silently ignored."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from embedcache.errors import UserError
from embedcache.federation_shapes import draw_sizes, load_shape
from embedcache.manifest import FINGERPRINT_KINDS, Client, Manifest, Sample

SCHEMES = ("feature-shift", "label-shift", "feature-label-shift")
PRESETS: dict[str, dict[str, Any]] = {
    "fedncm": {"scheme": "label-shift", "clients": 100, "alpha": 0.1, "train_fraction": 0.8},
    "feddra": {"scheme": "label-shift", "clients": 5, "alpha": 1.0, "train_fraction": 0.8,
               "domains": ("amazon", "caltech10")},
}
PAIRED_PRESETS = ("feddra",)  # presets that need a source with texts (contract 2a)
REDRAWS = 10  # Dirichlet re-draws when a client comes out below min_samples


# The options each scheme reads; any other option given is refused (with the reason below).
USES = {
    "feature-shift": {"train_per_class", "test_per_class", "train_fraction"},
    "label-shift": {"clients", "alpha", "train_fraction", "min_samples", "client_sizes"},
    "feature-label-shift": {"train_per_class", "test_per_class", "clients", "alpha"},
}
DEFAULTS = {"train_per_class": 10, "alpha": 1.0, "train_fraction": 0.1, "min_samples": 2}
LABEL_SHIFT_CLIENTS = 5  # feature-label shift defaults to one client per domain instead
_UNUSED = {
    "clients": "{scheme} makes one client per domain; choose domains with --domains",
    "alpha": "{scheme} draws no Dirichlet proportions (label-shift and feature-label-shift do)",
    "train_fraction": "{scheme} takes --train-per-class training images per class; label-shift and "
                      "feature-shift split by a fraction",
    "min_samples": "only label-shift re-draws clients that come out below it",
    "train_per_class": "{scheme} splits each client's samples by --train-fraction",
    "test_per_class": "{scheme} tests on the rest of each client's samples (--train-fraction sets the split)",
    "client_sizes": "a federation's client sizes go with label-shift (the clients of {scheme} follow its own rule)",
}
# label-shift options that --client-sizes replaces: sizes come from the shape, the pool's rest is the test set
_SIZED_UNUSED = {
    "train_fraction": "each client's training size comes from --client-sizes and the samples left over are the test sets",
    "min_samples": "each client's size comes from --client-sizes",
}


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


@dataclass(frozen=True)
class Recipe:
    """All partition arguments (recorded in the manifest). None = not given: the scheme's
    default applies if the scheme uses the option (see USES, DEFAULTS), else it stays null."""

    scheme: str
    train_per_class: int | None = None  # feature(-label) shift: N training images per class [10] (FedPCL: 10)
    test_per_class: int | None = None  # feature(-label) shift: cap on test images per class; None: the rest
    clients: int | None = None  # label shift: M [5]; feature-label shift: [one per domain]
    alpha: float | None = None  # label / feature-label shift: Dirichlet concentration [1.0]
    domains: tuple[str, ...] = ()  # restrict to these domains (label shift: one = --domain)
    train_fraction: float | None = None  # label shift: share of each client's samples used for training [0.1];
    #                                      feature shift: share of each class per domain, instead of train_per_class
    min_samples: int | None = None  # label shift: fewest samples (train + test) a Dirichlet client should get [2]
    fingerprint: str = "sha256"  # how each image is fingerprinted (ImageSource.fingerprint kinds; "stat": opt-in)
    captions: str | None = None  # set by partition(): the source's caption_origin when samples carry texts
    client_sizes: str | None = None  # label shift: training sizes of a real federation (federation_shapes name or CSV)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["domains"] = list(self.domains)
        for key in ("captions", "client_sizes"):  # manifests without them keep the bytes (and hashes) they had
            if d[key] is None:
                del d[key]
        return d

    def resolved(self) -> Recipe:
        """Checked, with the scheme's defaults filled in: UserError for an unknown scheme, an
        option this scheme would ignore, or a value out of range."""
        if self.scheme not in SCHEMES:
            raise UserError(f"--scheme {self.scheme!r}: must be one of {', '.join(SCHEMES)}")
        if self.fingerprint not in FINGERPRINT_KINDS:
            raise UserError(f"--fingerprint {self.fingerprint!r}: must be one of {', '.join(FINGERPRINT_KINDS)}")
        uses = USES[self.scheme]
        for option, why in _UNUSED.items():
            if option not in uses and getattr(self, option) is not None:
                raise UserError(f"{_flag(option)}: not used by {self.scheme} ({why.format(scheme=self.scheme)})")
        fixed: set[str] = set()
        if self.scheme == "feature-shift":  # N per class or a fraction, never both
            if self.train_fraction is not None and self.train_per_class is not None:
                raise UserError("--train-per-class and --train-fraction: feature-shift takes one of them")
            fixed = {"train_fraction"} if self.train_fraction is None else {"train_per_class"}
        if self.client_sizes is not None:
            for option, why in _SIZED_UNUSED.items():
                if getattr(self, option) is not None:
                    raise UserError(f"{_flag(option)}: not used with --client-sizes ({why})")
            fixed = set(_SIZED_UNUSED)
            load_shape(self.client_sizes)  # a bad name or file: one line before any work
        r = replace(self, **{k: v for k, v in DEFAULTS.items()
                             if k in uses and k not in fixed and getattr(self, k) is None})
        if r.scheme == "label-shift" and r.clients is None and r.client_sizes is None:
            r = replace(r, clients=LABEL_SHIFT_CLIENTS)
        if r.alpha is not None and r.alpha <= 0:
            raise UserError(f"--alpha {r.alpha}: must be > 0")
        for option in ("clients", "train_per_class"):
            if getattr(r, option) is not None and getattr(r, option) < 1:
                raise UserError(f"{_flag(option)} {getattr(r, option)}: must be >= 1")
        if r.test_per_class is not None and r.test_per_class < 0:
            raise UserError(f"--test-per-class {r.test_per_class}: must be >= 0")
        if r.min_samples is not None and r.min_samples < 0:
            raise UserError(f"--min-samples {r.min_samples}: must be >= 0")
        if r.train_fraction is not None and not 0.0 < r.train_fraction < 1.0:
            raise UserError(f"--train-fraction {r.train_fraction}: must be in (0, 1)")
        return r


def client_name(i: int, domain: str, width: int = 2) -> str:
    """c{i}-{domain}, with characters a client name may not hold replaced by "_"."""
    return f"c{i:0{width}d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', domain)}"


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
        if r.train_fraction is not None:
            train, test = _train_test([(loc, lab) for lab, locs in by_class.items() for loc in locs],
                                      r.train_fraction, rng, r.test_per_class)
            clients.append(Client(client_name(i, dom), dom, tuple(train), tuple(test)))
            continue
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
        clients.append(Client(client_name(i, dom), dom, tuple(train), tuple(test)))
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


def _train_test(items: list[tuple[str, int]], frac: float, rng: np.random.Generator,
                test_cap: int | None = None) -> tuple[list[Sample], list[Sample]]:
    """Per class: round(frac*n) training samples (at least 1 when the class has 2 or more), the
    rest (at most `test_cap` of them) for testing."""
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
        test += _samples(perm[n:] if test_cap is None else perm[n:n + test_cap], lab)
    return train, test


def sized_split(by_class: dict[int, list[str]], sizes: np.ndarray, alpha: float, rng: np.random.Generator,
                ) -> list[list[tuple[str, int]]]:
    """Client i takes exactly sizes[i] samples, its classes drawn by q_i ~ Dirichlet(alpha * C * p),
    p the pool's class frequencies (Hsu et al. 2019, Section 3: the prior as the Dirichlet's mean;
    with equal classes, feature & label shift's Dirichlet(alpha)), without replacement: a class that
    runs out is dropped from q_i and the rest re-drawn. The caller checks that the pool holds sum(sizes)."""
    labs = sorted(by_class)
    pools = [[by_class[c][j] for j in rng.permutation(len(by_class[c]))] for c in labs]
    left = np.array([len(p) for p in pools], dtype=np.int64)
    conc = alpha * len(labs) * left / left.sum()
    parts: list[list[tuple[str, int]]] = []
    for n in sizes:
        q = rng.gamma(conc)  # Dirichlet(conc) unnormalised; normalised below with the classes still available
        take = np.zeros(len(labs), dtype=np.int64)
        need = int(n)
        while need > 0:
            w = q * (left > take)
            w = w / w.sum() if w.sum() > 0 else (left > take) / (left > take).sum()
            take = np.minimum(take + rng.multinomial(need, w), left)
            need = int(n) - int(take.sum())
        items = []
        for j in np.flatnonzero(take):
            got, pools[j] = pools[j][: take[j]], pools[j][take[j]:]
            items += [(loc, labs[j]) for loc in got]
        left -= take
        parts.append(items)
    return parts


def _sized_clients(pooled: dict[int, list[str]], dom: str, r: Recipe, rng: np.random.Generator,
                   report: dict[str, Any]) -> list[Client]:
    """Label shift with the training sizes of a real federation (`--client-sizes`); test sets: the
    rest of each class, dealt in turn to the clients that hold it."""
    shape = load_shape(str(r.client_sizes))
    sizes = draw_sizes(shape, r.clients)
    total = sum(len(v) for v in pooled.values())
    if int(sizes.sum()) > total:
        fit = max(1, int(total // shape.mean()))
        while fit > 1 and int(draw_sizes(shape, fit).sum()) > total:
            fit -= 1
        raise UserError(f"--client-sizes {r.client_sizes}: {len(sizes)} clients need {int(sizes.sum())} training "
                        f"samples and the source has {total}; use --clients {fit} (the most that fit) or a larger source")
    sizes = sizes[rng.permutation(len(sizes))]
    parts = sized_split(pooled, sizes, r.alpha if r.alpha is not None else DEFAULTS["alpha"], rng)
    used = {loc for items in parts for loc, _ in items}
    owners: dict[int, list[int]] = defaultdict(list)
    for i, items in enumerate(parts):
        for lab in sorted({lab for _, lab in items}):
            owners[lab].append(i)
    tests: list[list[Sample]] = [[] for _ in parts]
    for lab, locs in pooled.items():
        rest = [loc for loc in locs if loc not in used]
        for j, loc in enumerate(rest):
            if owners[lab]:
                tests[owners[lab][j % len(owners[lab])]] += _samples([loc], lab)
    unused = sum(len(v) for lab, v in pooled.items() if not owners[lab])
    if unused:
        report.setdefault("warnings", []).append(
            f"{unused} sample(s) of classes no client trains on are in no test set")
    report["client_sizes"] = {"shape": str(r.client_sizes), "clients": len(sizes), "train_samples": int(sizes.sum()),
                              "median": float(np.median(sizes)), "largest": int(sizes.max())}
    width = max(2, len(str(len(parts) - 1)))
    return [Client(client_name(i, dom, width), dom, tuple(_samples([loc], lab)[0] for loc, lab in items),
                   tuple(tests[i])) for i, items in enumerate(parts)]


def label_shift(groups: dict[str, dict[int, list[str]]], classes: Sequence[str], r: Recipe,
                rng: np.random.Generator, report: dict[str, Any]) -> list[Client]:
    pooled: dict[int, list[str]] = defaultdict(list)
    for by_class in groups.values():
        for lab, locs in by_class.items():
            pooled[lab] += locs
    pooled = {k: sorted(v) for k, v in sorted(pooled.items())}
    dom = next(iter(groups)) if len(groups) == 1 else "pooled"
    if r.client_sizes is not None:
        return _sized_clients(pooled, dom, r, rng, report)
    m = r.clients or LABEL_SHIFT_CLIENTS
    parts = dirichlet_split(pooled, m, r.alpha, rng, r.min_samples, report)
    clients = []
    for i, items in enumerate(parts):
        train, test = _train_test(items, r.train_fraction, rng)
        clients.append(Client(client_name(i, dom, max(2, len(str(m - 1)))), dom, tuple(train), tuple(test)))
    return clients


def feature_label_shift(groups: dict[str, dict[int, list[str]]], classes: Sequence[str], r: Recipe,
                        rng: np.random.Generator, report: dict[str, Any]) -> list[Client]:
    doms = list(groups)
    m = r.clients or len(doms)
    C = len(classes)
    pools = {d: {lab: [locs[j] for j in rng.permutation(len(locs))] for lab, locs in groups[d].items()} for d in doms}
    plan = []
    short: list[str] = []
    width = max(2, len(str(m - 1)))
    for i in range(m):
        d = doms[i % len(doms)]
        q = rng.dirichlet(np.full(C, r.alpha))
        want = rng.multinomial(r.train_per_class * C, q)
        train = []
        for lab in range(C):
            avail = pools[d].get(lab, [])
            take = min(int(want[lab]), len(avail))
            if take < want[lab]:
                short.append(f"{client_name(i, d, width)}/{classes[lab]}: {len(avail)} images left in {d} "
                             f"for {int(want[lab])} drawn")
            train += _samples(avail[:take], lab)
            pools[d][lab] = avail[take:]
        plan.append((d, train))
    if short:
        report["short_classes"] = short
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
    return [Client(client_name(i, d, width), d, tuple(tr), tuple(tests[i])) for i, (d, tr) in enumerate(plan)]


_SCHEME_FN = {"feature-shift": feature_shift, "label-shift": label_shift, "feature-label-shift": feature_label_shift}


def _fingerprinted(clients: list[Client], source: Any, kind: str) -> list[Client]:
    """The clients with every sample's fingerprint filled in (UserError for a missing image)."""
    from embedcache.sources.drift import fingerprint_all

    locs = [s.locator for c in clients for split in (c.train, c.test) for s in split]
    fps = dict(zip(locs, fingerprint_all(source, locs, kind)))
    bad = [fp for fp in fps.values() if isinstance(fp, UserError)]
    if bad:
        raise UserError(f"{len(bad)} image(s) cannot be fingerprinted (e.g. {bad[0]})")

    def fill(samples: Sequence[Sample]) -> tuple[Sample, ...]:
        return tuple(replace(s, fingerprint=str(fps[s.locator])) for s in samples)

    return [replace(c, train=fill(c.train), test=fill(c.test)) for c in clients]


def _with_texts(clients: list[Client], source: Any, report: dict[str, Any]) -> list[Client]:
    """The clients with every sample's text from source.caption (UserError, one line, when a
    sample has none: a manifest is paired or text-free)."""
    from embedcache.sources.captions import caption_all

    locs = sorted({s.locator for c in clients for split in (c.train, c.test) for s in split})
    texts = dict(zip(locs, caption_all(source.caption, locs)))
    bad = [t for t in texts.values() if isinstance(t, UserError)]
    if bad:
        raise UserError(f"{len(bad)} sample(s) have no text (e.g. {bad[0]})")
    unknown = getattr(source, "unknown_caption_locators", lambda: [])()
    if unknown:
        report.setdefault("warnings", []).append(
            f"{len(unknown)} caption line(s) name no image of {source.spec} (e.g. {unknown[0]})")

    def fill(samples: Sequence[Sample]) -> tuple[Sample, ...]:
        return tuple(replace(s, text=str(texts[s.locator])) for s in samples)

    return [replace(c, train=fill(c.train), test=fill(c.test)) for c in clients]


def partition(source: Any, recipe: Recipe, seed: int, *, require_texts: bool = False) -> Manifest:
    """Build the manifest of `recipe` over `source` (an ImageSource, contract 2). Samples get
    their texts when the source has them; `require_texts` refuses a source without."""
    recipe = recipe.resolved()
    origin = getattr(source, "caption_origin", None)
    if require_texts and origin is None:
        raise UserError(f"{source.spec}: has no texts and this setting pairs every image with one; use "
                        f"captioned:{source.spec} (generated captions) or give the images a captions.tsv")
    classes = list(source.classes())
    groups = _by_domain_class(source.index())
    if recipe.domains:
        for d in recipe.domains:
            if d not in groups:
                raise UserError(f"domain {d!r}: not in {source.spec} (domains: {', '.join(groups)})")
        groups = {d: groups[d] for d in recipe.domains}
    if recipe.scheme == "feature-label-shift" and recipe.clients is None:
        recipe = replace(recipe, clients=len(groups))  # recorded as what it is
    if recipe.client_sizes is not None and recipe.clients is None:
        recipe = replace(recipe, clients=len(load_shape(recipe.client_sizes)))  # the shape's own clients
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
    if recipe.min_samples is not None:
        few = {c.name: len(c.train) for c in clients if len(c.train) < recipe.min_samples}
        if few:
            report["small_clients"] = few
    no_test = [c.name for c in clients if not c.test]
    if no_test:
        report["clients_without_test"] = no_test
    _missing_report(clients, classes, report)
    report["sizes"] = {c.name: [len(c.train), len(c.test)] for c in clients}
    clients = _fingerprinted(clients, source, recipe.fingerprint)
    if origin is not None:
        clients = _with_texts(clients, source, report)
    recipe = replace(recipe, captions=None if origin is None else str(origin))
    return Manifest(source=source.spec, classes=tuple(classes), clients=tuple(clients),
                    recipe=recipe.as_dict(), seed=int(seed), report=report).validate()
