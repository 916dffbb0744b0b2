"""The papers' data sets, how to point the pipelines at a real copy, and the offline stand-ins.

Offline, `builtin:digits` stands in for Digit-5 and the real Office-Caltech-10 under
`{assets}/data` (`$EMBEDCACHE_ASSETS`, else `../shared`) is the papers' Office-10. A user with a
real copy passes `--source KEY=imagefolder:PATH` (layouts in data_manifests/README.md) and gets
the paper's data with nothing else changed; folder names are matched to the paper's domains
through the aliases below (case-insensitive).
"""

from __future__ import annotations

import os
from pathlib import Path

from embedcache.errors import UserError
from pipelines.spec import DataRecipe, Dataset

_DIGIT_CLASSES = tuple(str(i) for i in range(10))
# FedPCL's DomainNet subset: the label_dict of the authors' code (lib/data_utils.py, DomainNetDataset)
DOMAINNET_CLASSES = ("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill",
                     "wine_glass", "zebra")

DATASETS: dict[str, Dataset] = {d.key: d for d in (
    Dataset(
        key="digit5", paper_name="Digit-5", domains=("MNIST", "SVHN", "USPS", "Synth", "MNIST-M"),
        layout="digit5/{mnist,svhn,usps,synth,mnistm}/<0..9>/*.png (PNGs written once from the .mat/.pkl files)",
        aliases=(("MNIST", ("mnist",)), ("SVHN", ("svhn",)), ("USPS", ("usps",)),
                 ("Synth", ("synth", "syn", "synthdigits", "synth_digits")),
                 ("MNIST-M", ("mnistm", "mnist_m", "mnist-m"))),
        classes=_DIGIT_CLASSES, standin="builtin:digits",
        standin_domains=(("MNIST", "mnist"), ("SVHN", None), ("USPS", "uci"), ("Synth", "synth"),
                         ("MNIST-M", "mnistm")),
        standin_note="builtin:digits stands in for Digit-5 (real MNIST and UCI scans for USPS, MNIST-M- and "
                     "SynthDigits-style domains made from them, 32 px; no SVHN)"),
    Dataset(
        key="office10", paper_name="Office-10", domains=("Amazon", "Caltech", "DSLR", "WebCam"),
        layout="office_caltech10/{amazon,caltech10,dslr,webcam}/<class>/*.jpg (as distributed)",
        aliases=(("Amazon", ("amazon",)), ("Caltech", ("caltech10", "caltech")), ("DSLR", ("dslr",)),
                 ("WebCam", ("webcam",))),
        standin="imagefolder:{assets}/data/office_caltech10",  # copies name classes differently (back_pack)
        standin_domains=(("Amazon", "amazon"), ("Caltech", "caltech10"), ("DSLR", "dslr"), ("WebCam", "webcam")),
        standin_note=""),  # the real Office-Caltech-10: the papers' data, no stand-in
    Dataset(
        key="domainnet", paper_name="DomainNet",
        domains=("Clipart", "Info", "Painting", "Quickdraw", "Real", "Sketch"),
        layout="domainnet/{clipart,infograph,painting,quickdraw,real,sketch}/<class>/*.jpg holding only FedPCL's "
               "10 classes (" + ", ".join(DOMAINNET_CLASSES) + "): make a folder of symlinks",
        aliases=(("Clipart", ("clipart",)), ("Info", ("infograph", "info")), ("Painting", ("painting",)),
                 ("Quickdraw", ("quickdraw",)), ("Real", ("real",)), ("Sketch", ("sketch",))),
        classes=DOMAINNET_CLASSES),
    Dataset(
        key="cifar10", paper_name="CIFAR-10", domains=("CIFAR-10",),
        layout="cifar10/train/<class>/*.png (one folder level for the domain)",
        aliases=(("CIFAR-10", ("train", "cifar10", "cifar-10", "all")),),
        standin="imagefolder:{assets}/data/office_caltech10",
        standin_domains=(("CIFAR-10", None),),  # None with a stand-in: pool every stand-in domain
        standin_note="Office-Caltech-10 (2,533 images, 4 domains pooled) stands in for CIFAR-10 (50,000 images)"),
    *(Dataset(key=k, paper_name=n, domains=(n,), layout=f"{k}/train/<class>/*.jpg (one folder level for the domain)",
              aliases=((n, ("train", k, "all")),))
      for k, n in (("flowers102", "Flowers-102"), ("cub", "CUB"), ("cars", "Stanford Cars"),
                   ("eurosat-sub", "EuroSAT-Sub"))),
    Dataset(
        key="mimic-cxr", paper_name="MIMIC-CXR", domains=("MIMIC-CXR",),
        layout="image-report pairs: imagefolder PATH/<domain>/<class>/<image> with PATH/captions.tsv",
        aliases=(("MIMIC-CXR", ("train", "mimic", "all")),),
        standin="captioned:imagefolder:{assets}/data/office_caltech10",
        standin_domains=(("MIMIC-CXR", None),),
        standin_note="captioned Office-Caltech-10 (captions derived from class and pixels, FedDRA design notes) "
                     "stands in for MIMIC-CXR image-report pairs"),
)}


def assets_dir() -> Path | None:
    """$EMBEDCACHE_ASSETS, else ../shared beside the repository or the working directory."""
    env = os.environ.get("EMBEDCACHE_ASSETS")
    cands = [Path(env)] if env else [Path(__file__).resolve().parents[2] / "shared", Path.cwd().parent / "shared"]
    return next((c for c in cands if c.is_dir()), None)


def parse_sources(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--source KEY=SPEC` values -> {key: spec} (UserError for an unknown key or a bad item)."""
    out: dict[str, str] = {}
    for it in items:
        key, eq, spec = it.partition("=")
        if not eq or not spec.strip():
            raise UserError(f"--source {it!r}: expected KEY=SPEC, e.g. digit5=imagefolder:/data/digit5")
        if key.strip() not in DATASETS:
            raise UserError(f"--source {key!r}: unknown data set (known: {', '.join(DATASETS)})")
        out[key.strip()] = spec.strip()
    return out


def resolve_source(dataset: str, sources: dict[str, str]) -> tuple[str | None, bool, str]:
    """(source spec or None, is_original, why) for a data set: the user's copy when given, else the
    offline stand-in when its files exist, else None with the reason."""
    ds = DATASETS[dataset]
    if dataset in sources:
        return sources[dataset], True, f"{ds.paper_name} from --source {dataset}"
    if not ds.standin:
        return None, False, (f"no offline copy of {ds.paper_name}: pass --source {dataset}=imagefolder:PATH "
                             f"({ds.layout})")
    spec = ds.standin
    if "{assets}" in spec:
        a = assets_dir()
        if a is None:
            return None, False, (f"{ds.paper_name} stand-in needs ../shared (or $EMBEDCACHE_ASSETS); or pass "
                                 f"--source {dataset}=imagefolder:PATH ({ds.layout})")
        spec = spec.replace("{assets}", str(a))
    return spec, False, ds.standin_note or f"{ds.paper_name} (offline copy)"


def map_domains(dataset: str, paper_domains: tuple[str, ...], available: list[str],
                original: bool) -> list[tuple[str, str | None]]:
    """(paper domain, source domain or None) for `paper_domains` (() = all of the paper's).

    Original copies: each paper domain is found among `available` through its aliases (UserError
    naming what is there when one is missing). Stand-ins: the fixed stand-in map; None = no
    stand-in for that domain (reported, skipped)."""
    ds = DATASETS[dataset]
    wanted = paper_domains or ds.domains
    if not original:
        m = dict(ds.standin_domains)
        return [(d, m.get(d)) for d in wanted]
    low = {a.lower(): a for a in available}
    aliases = dict(ds.aliases)
    out: list[tuple[str, str | None]] = []
    for d in wanted:
        hit = next((low[a] for a in aliases.get(d, (d.lower(),)) if a in low), None)
        if hit is None and len(ds.domains) == 1 and len(available) == 1:
            hit = available[0]  # a one-domain data set in a folder of any name
        if hit is None:
            raise UserError(f"{ds.paper_name}: no folder for domain {d} (looked for "
                            f"{', '.join(aliases.get(d, (d,)))}; found {', '.join(available) or 'nothing'}); "
                            f"expected layout {ds.layout}")
        out.append((d, hit))
    return out


def missing_domains(recipe: DataRecipe, original: bool) -> tuple[str, ...]:
    """The paper's domains of `recipe` that the offline stand-in has no counterpart for (e.g.
    Digit-5's SVHN); () with a real copy, a pooled stand-in or a one-domain data set."""
    ds = DATASETS[recipe.dataset]
    if original or recipe.standin_domains is not None or len(ds.domains) == 1:
        return ()
    m = dict(ds.standin_domains)
    return tuple(d for d in (recipe.domains or ds.domains) if d in m and m[d] is None)


def check_classes(dataset: str, classes: list[str], spec: str) -> None:
    """A real copy must hold exactly the classes the paper uses (when the paper fixes them)."""
    ds = DATASETS[dataset]
    if ds.classes and sorted(classes) != sorted(ds.classes):
        extra = sorted(set(classes) - set(ds.classes))
        lack = sorted(set(ds.classes) - set(classes))
        what = (f"{len(extra)} classes the paper does not use (e.g. {extra[0]})" if extra else
                f"no class {lack[0]}")
        raise UserError(f"{spec}: {what}; {ds.paper_name} here means the classes {', '.join(ds.classes)} "
                        f"(layout: {ds.layout})")
