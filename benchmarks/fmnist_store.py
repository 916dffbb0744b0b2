"""EfficientNet-Lite0 features of Fashion-MNIST in an embedcache store (bench_peers' protocols 2-3).

Fashion-MNIST's IDX files (the Debian package dataset-fashion-mnist puts them, gzipped, in
/usr/share/datasets/fashion-mnist; raw files work too) are written once as PNG files into an image
folder (one domain, `fashion-mnist/<class>/<split>-<index>.png`), described by a manifest with one
client whose train and test splits are the data set's own (60,000 / 10,000 images), and extracted
by `embedcache.api.extract` with the backbone's own preprocessing (grey images are converted to
RGB and resized by it). Everything is built into a cache directory keyed by the IDX files' bytes
and the backbone; a build that did not finish is resumed by the store (extraction is resumable)
and the manifest is rewritten identically.

Usage: python benchmarks/fmnist_store.py [--fashion-mnist DIR] [--backbone efficientnet-lite0]
           [--cache-dir DIR] [--scheduler local:2] [--limit N]     (prints the store path)
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

from bench_peers import FMNIST, read_idx  # sibling module (benchmarks/ is on sys.path)

CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot")
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _find(folder: Path, stem: str) -> Path:
    for p in (folder / stem, folder / f"{stem}.gz"):
        if p.is_file():
            return p
    raise SystemExit(f"error: {folder}: no {stem} (or {stem}.gz); install the Debian package "
                     "dataset-fashion-mnist or pass --fashion-mnist")


def build(folder: Path, backbone: str, cache: Path, scheduler: str | None, limit: int = 0) -> Path:
    """The store's path, after extracting whatever it lacks; `limit` > 0 takes the first `limit`
    images of each split (a smoke test, keyed apart)."""
    from PIL import Image

    from embedcache.api import extract
    from embedcache.manifest import Client, Manifest, Sample, save_manifest
    from embedcache.sources.imagefolder import ImageFolder

    paths = {s: [_find(folder, f) for f in fs] for s, fs in FILES.items()}
    digest = hashlib.sha256()
    for s in ("train", "test"):
        for p in paths[s]:
            digest.update(hashlib.sha256(p.read_bytes()).digest())
    root = cache / f"fmnist-{digest.hexdigest()[:12]}{f'-first{limit}' if limit else ''}"
    images = root / "images"
    samples: dict[str, list[Sample]] = {}
    images.mkdir(parents=True, exist_ok=True)
    source = ImageFolder(f"imagefolder:{images}", str(images))
    for split, (xp, yp) in paths.items():
        x, y = read_idx(xp), read_idx(yp)
        if limit:
            x, y = x[:limit], y[:limit]
        rows = []
        for i, (img, label) in enumerate(zip(x, y)):
            loc = f"fashion-mnist/{CLASSES[int(label)]}/{split}-{i:05d}.png"
            path = images / loc
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                Image.fromarray(img, mode="L").save(tmp, format="PNG")
                os.replace(tmp, path)
            rows.append(Sample(id=f"{split}-{i:05d}", locator=loc, label=int(label),
                               fingerprint=source.fingerprint(loc, "stat")))
        samples[split] = rows
    manifest = Manifest(source=f"imagefolder:{images}", classes=CLASSES,
                        clients=(Client("fashion-mnist", "fashion-mnist", tuple(samples["train"]),
                                        tuple(samples["test"])),),
                        recipe={"note": "Fashion-MNIST's own train/test split, one client"}, seed=0).validate()
    save_manifest(manifest, root / "manifest.json")
    store = root / "store"
    extract(root / "manifest.json", backbone, store, device="cpu", scheduler=scheduler)
    return store


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fashion-mnist", default=str(FMNIST))
    ap.add_argument("--backbone", default="efficientnet-lite0")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "fedfrozen-bench"))
    ap.add_argument("--scheduler", default=None, help="None: this process; local:N: a dask LocalCluster")
    ap.add_argument("--limit", type=int, default=0, help="only the first N images of each split (smoke test)")
    a = ap.parse_args(argv)
    print(build(Path(a.fashion_mnist), a.backbone, Path(a.cache_dir), a.scheduler, a.limit))


if __name__ == "__main__":
    main()
