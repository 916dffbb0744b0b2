"""New images for `fedheads predict` (docs/contracts.md, 6c): `--images imagefolder:PATH` or
`--manifest M` are extracted with every backbone of the trained run, by embedcache's own extract
(drift check, cache keys, resume), into a cache store; fedheads.predict then classifies from it.

Each backbone is created and compared with what the run recorded of its training features
(weights sha256, preprocessing, dimension) BEFORE an image is decoded: a backbone whose weights
or preprocessing changed since training would give features the heads never saw, and silently
wrong predictions. Extraction uses the training store's batch size, chunking and dtype, so the
training manifest's images give the training store's features bit for bit."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from embedcache.errors import UserError
from embedcache.manifest import Client, Manifest, Sample, load_manifest
from fedheads.prediction.trained import Part
from fedheads.run.identity import mismatch
from fedheads.run.saved import Trained


@dataclass(frozen=True)
class ExtractOptions:
    """How new images are extracted (the `embedcache extract` options predict passes on)."""

    cache: str  # the cache store (default RUN_DIR/predict-cache)
    device: str = "cpu"
    batch_size: int | None = None  # None: the training store's
    num_workers: int = 2  # decode threads
    weights_dir: str | None = None
    plugins: tuple[str, ...] = ()  # modules registering custom backbones
    progress: bool = False


def _recorded(tr: Trained) -> dict[str, Any]:
    if tr.fingerprint is None:
        raise UserError("run: trained on numpy arrays, it records no backbone to extract new images with; "
                        "classify features (Result.predict(features)) or a --store")
    return tr.fingerprint["backbones"]


def checked_backbones(tr: Trained, opts: ExtractOptions) -> dict[str, Any]:
    """Every backbone of the run, created and checked against the training features' identity."""
    from embedcache.backbones import create_backbone
    from embedcache.devices import resolve_device
    from embedcache.plugins import import_plugins

    recorded = _recorded(tr)
    import_plugins(opts.plugins)
    device = str(resolve_device(opts.device))
    made = {}
    for name in tr.backbones:
        bb = create_backbone(name, weights_dir=opts.weights_dir, device=device)
        now = {"dim": int(bb.feature_dim), "weights_sha256": bb.weights_sha256, "preprocess": dict(bb.preprocess)}
        msg = mismatch(name, recorded[name], now)
        if msg:
            raise UserError(f"{msg}: the run's heads were trained on other features; predict with the "
                            "training backbone's weights (--weights-dir) or retrain")
        made[name] = bb
    return made


def extract_for_run(tr: Trained, manifest: Manifest, source: Any, opts: ExtractOptions) -> None:
    """`manifest` extracted into the cache with each of the run's backbones, as training's store was."""
    from embedcache.extraction import ExtractConfig, extract
    from embedcache.store.writer import DEFAULT_CHUNK_ROWS

    recorded = _recorded(tr)
    for name, bb in checked_backbones(tr, opts).items():
        rec = recorded[name]
        cfg = ExtractConfig(backbones=(name,), store=opts.cache, device=opts.device,
                            batch_size=opts.batch_size or int(rec.get("batch_size", 64)),
                            num_workers=opts.num_workers, dtype=str(rec.get("dtype", "float32")),
                            weights_dir=opts.weights_dir, chunk_rows=int(rec.get("chunk_rows", DEFAULT_CHUNK_ROWS)),
                            plugins=opts.plugins, progress=opts.progress)
        extract(manifest, cfg, source=source, backbone_factory=lambda n, wd, dev, bb=bb: bb)


def scan_images(root: Path) -> dict[str, list[str]]:
    """{top-level folder ("" for loose files): sorted image paths relative to root}, recursively;
    hidden files and folders are skipped."""
    from embedcache.sources.imagefolder import IMAGE_SUFFIXES

    groups: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = Path(dirpath).relative_to(root)
        for f in sorted(filenames):
            if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_SUFFIXES:
                groups.setdefault(rel.parts[0] if rel.parts else "", []).append((rel / f).as_posix())
    return dict(sorted(groups.items()))


def shard_name(root: Path, group: str) -> str:
    """A cache client name per (folder, top-level group): readable, unique, stable across runs."""
    h = hashlib.sha256(f"{root}\0{group}".encode()).hexdigest()[:10]
    return f"img-{re.sub(r'[^A-Za-z0-9_.-]', '_', group)[:40] or 'loose'}-{h}"


LAYOUTS = "PATH/<class>/<image> or PATH/<domain>/<class>/<image>"  # the layouts whose folders give labels


def image_labels(tr: Trained, spec: str, source: Any, groups: dict[str, list[str]]) -> dict[str, int]:
    """{image path: the run's class id} for the images whose folder names a class of the run.

    Two layouts: class folders at the top (PATH/<class>/..., any depth below), or, when no top
    folder is a class, the `<domain>/<class>/<image>` layout `embedcache partition` reads (walked
    by the imagefolder source itself). In the latter every class folder must be one of the run's:
    another name would mean another class list, hence mislabelled accuracy (one line naming it)."""
    cid = {c: i for i, c in enumerate(tr.classes)}
    if any(g in cid for g in groups):
        return {f: cid[g] for g, files in groups.items() if g in cid for f in files}
    scanned = {f for files in groups.values() for f in files}
    if not any(len(f.split("/")) == 3 and f.split("/")[1] in cid for f in scanned):
        return {}
    names = source.classes()
    found = [(loc, names[i]) for _, loc, i in source.index() if loc in scanned]
    unknown = sorted({loc.rsplit("/", 1)[0] for loc, c in found if c not in cid})
    if unknown:
        raise UserError(f"--images {spec}: class folder {unknown[0]} is not a class of the run "
                        f"({', '.join(tr.classes[:10])}{' ...' if len(tr.classes) > 10 else ''}); "
                        "in the <domain>/<class>/<image> layout every class folder must be one")
    return {loc: cid[c] for loc, c in found}


def extract_images(tr: Trained, spec: str, by: tuple[str | None, ...], opts: ExtractOptions) -> list[Part]:
    """`imagefolder:PATH` as cache shards (test split), one per top-level folder and labelled or
    not (image_labels); an input where some or all images have no label says so in one note."""
    from embedcache.sources.imagefolder import IMAGE_SUFFIXES, ImageFolder
    from fedheads.prediction.trained import note

    kind, sep, path = spec.partition(":")
    if kind != "imagefolder" or not sep or not path:
        raise UserError(f"--images {spec}: expected imagefolder:PATH ({LAYOUTS} for labels, or any images)")
    _recorded(tr)
    root = Path(path).expanduser().resolve()
    source = ImageFolder(f"imagefolder:{root}", str(root))  # one line when the folder is missing
    groups = scan_images(root)
    if not groups:
        raise UserError(f"--images {spec}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) under {root}")
    labels = image_labels(tr, spec, source, groups)
    if not labels:
        note(f"--images: no image has a label (labels come from {LAYOUTS}, class folders named like the "
             f"run's classes: {', '.join(tr.classes[:5])}{' ...' if len(tr.classes) > 5 else ''}); "
             "predictions only, no accuracy")
    elif any(g in tr.classes for g in groups):
        others = [g for g in groups if g and g not in tr.classes]
        if others:
            note(f"--images: folders {', '.join(others[:3])}{' ...' if len(others) > 3 else ''} are not classes "
                 "of the run; their images are unlabelled (no accuracy)")
    else:
        stray = [f for files in groups.values() for f in files if f not in labels]
        if stray:
            note(f"--images: {len(stray)} image{'s' if len(stray) > 1 else ''} outside <domain>/<class>/ folders "
                 f"({', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}): unlabelled, not in the accuracy")
    clients, parts = [], []
    for g, files in groups.items():
        for labelled in (True, False):
            mine = [f for f in files if (f in labels) == labelled]
            if not mine:
                continue
            key = g if labelled or not any(f in labels for f in files) else f"{g}/(unlabelled)"
            samples = tuple(Sample(f, f, labels.get(f, 0), source.fingerprint(f, "sha256")) for f in mine)
            name = shard_name(root, key)
            clients.append(Client(name, g or "(loose)", (), samples))
            parts.append(Part(name, "test", by, labelled=labelled))
    manifest = Manifest(source.spec, tuple(tr.classes), tuple(clients),
                        recipe={"scheme": "predict-images", "fingerprint": "sha256"}).validate(spec)
    extract_for_run(tr, manifest, source, opts)
    return parts


def extract_manifest(tr: Trained, manifest: Any, split: str, client: str, opts: ExtractOptions) -> list[Part]:
    """A manifest's `split` of `client` (or all its clients), each sample by its own client's state."""
    from embedcache.store.writer import store_root

    where = str(manifest) if isinstance(manifest, (str, Path)) else "manifest"
    m = load_manifest(manifest) if isinstance(manifest, (str, Path)) else manifest
    _recorded(tr)
    if list(m.classes) != list(tr.classes):
        raise UserError(f"{where}: classes {list(m.classes)[:5]} differ from the run's {tr.classes[:5]}; "
                        "predictions would be mislabelled")
    names = [c.name for c in m.clients]
    wanted = names if client == "all" else [client]
    for c in wanted:
        if c not in names:
            raise UserError(f"--client {c}: not a client of {where} (clients: {', '.join(names)})")
        if c not in tr.clients:
            raise UserError(f"{where}: client {c} is not a client of the run (it has no state to classify with; "
                            f"run clients: {', '.join(tr.clients)})")
    root = store_root(opts.cache)
    if root is None or root.get("manifest_hash") != m.content_hash:
        # only what is asked for; the kept split's sample-list hash (its cache key) is M's own
        keep = lambda c, s: getattr(c, s) if s == split else ()  # noqa: E731
        m = replace(m, clients=tuple(replace(c, train=keep(c, "train"), test=keep(c, "test"))
                                     for c in m.clients if c.name in wanted),
                    recipe={**m.recipe, "predict_subset_of": m.content_hash, "predict_split": split})
    extract_for_run(tr, m, None, opts)
    return [Part(c, split, (c,)) for c in wanted]
