"""The Python API of `embedcache`, one function per command (the CLI takes the same arguments):

    embedcache.partition(source, scheme=..., out=None)      -> Manifest       (`embedcache partition`)
    embedcache.extract(manifest, backbones, store, ...)     -> ExtractReport  (`embedcache extract`)
    embedcache.open_store(store)                            -> StoreInfo      (`embedcache inspect`)
    embedcache.load_split(store, backbones, split)          -> {client: ClientSplit (numpy)}
    embedcache.import_features(source, store, ...)          -> [ShardSpec]    (`embedcache import`)
    embedcache.export(store, out, format="h5")              -> shard count    (`embedcache export`)

The work is done by `embedcache.partitioning`, `embedcache.extraction` and `embedcache.store`;
nothing heavy is imported until a function runs."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedcache.errors import UserError

if TYPE_CHECKING:
    from embedcache.extraction import ExtractReport
    from embedcache.manifest import Manifest
    from embedcache.store.reader import ClientSplit, StoreInfo


def partition(source: str | Any, scheme: str | None = None, *, preset: str | None = None,
              train_per_class: int | None = None, test_per_class: int | None = None,
              clients: int | None = None, alpha: float | None = None,
              domains: Sequence[str] | str = (), train_fraction: float | None = None,
              min_samples: int | None = None, fingerprint: str = "sha256", seed: int = 0,
              out: str | Path | None = None, client_sizes: str | Path | None = None) -> Manifest:
    """Partition `source` into clients, as `embedcache partition`: the data manifest.

    source: "imagefolder:PATH" | "jda-digits:FILE.mat" | "builtin:digits" | "captioned:<one of
        these>", or an opened ImageSource.
    scheme: "feature-shift" | "label-shift" | "feature-label-shift" (FedPCL Tables 8-10), or a
        `preset` ("fedncm", "feddra"); options left None take the scheme's default.
    client_sizes: label shift with a real federation's training sizes per client, a name in
        embedcache.federation_shapes.SHAPES (e.g. "inaturalist-users-120k") or a CSV of sizes;
        `clients` then draws that many sizes at the shape's quantiles (default: its own, exactly).
    out: also write the manifest there (.json, .yaml or .yml). What the partitioner had to handle
        (clients without test samples, missing classes) is in `manifest.report`."""
    from embedcache.manifest import SUFFIXES, save_manifest
    from embedcache.partitioning import PAIRED_PRESETS, PRESETS, Recipe
    from embedcache.partitioning import partition as run_partition
    from embedcache.sources import open_source

    if out is not None and Path(out).suffix.lower() not in SUFFIXES:  # before any work
        raise UserError(f"--out {out}: must end in .json, .yaml or .yml")
    if preset is not None and preset not in PRESETS:
        raise UserError(f"--preset {preset!r}: must be one of {', '.join(PRESETS)}")
    base: dict[str, Any] = dict(PRESETS[preset]) if preset else {}
    if scheme is None and "scheme" not in base:
        raise UserError(f"--scheme: required (or --preset {' / '.join(PRESETS)})")
    if preset and client_sizes is not None:
        raise UserError(f"--client-sizes: --preset {preset} fixes its own clients and split; use "
                        f"--scheme label-shift --client-sizes {client_sizes}")
    if preset and scheme is not None and scheme != base["scheme"]:
        raise UserError(f"--scheme {scheme}: --preset {preset} is {base['scheme']}; drop one of them")
    given = {"scheme": scheme, "train_per_class": train_per_class, "test_per_class": test_per_class,
             "clients": clients, "alpha": alpha, "train_fraction": train_fraction, "min_samples": min_samples,
             "client_sizes": None if client_sizes is None else str(client_sizes)}
    base.update({k: v for k, v in given.items() if v is not None})
    doms = tuple(d.strip() for d in (domains.split(",") if isinstance(domains, str) else domains) if d.strip())
    preset_doms = tuple(base.pop("domains", ()))
    recipe = Recipe(domains=doms or preset_doms, fingerprint=fingerprint, **base)
    src = open_source(source) if isinstance(source, str) else source
    manifest = run_partition(src, recipe, seed, require_texts=preset in PAIRED_PRESETS)
    if out is not None:
        save_manifest(manifest, out)
    return manifest


def expand_default(names: Sequence[str], weights_dir: str | None) -> tuple[tuple[str, ...], str | None]:
    """(`default` replaced by the backbones `embedcache backbones` calls default here, why; None
    when `default` was not asked for)."""
    if "default" not in names:
        return tuple(names), None
    from embedcache.backbones import default_backbones_with_reason

    default, why = default_backbones_with_reason(weights_dir)
    out: list[str] = []
    for n in names:
        for m in (default if n == "default" else [n]):
            if m not in out:
                out.append(m)
    return tuple(out), f"default = {', '.join(default)} ({why})"


def extract(manifest: str | Path | Manifest, backbones: Sequence[str] | str, store: str | Path, *,
            device: str = "auto", batch_size: int = 64, num_workers: int = 2, scheduler: str | None = None,
            views: int = 1, dtype: str = "float32", cut: str | None = None, weights_dir: str | None = None,
            chunk_rows: int = 256, plugins: Sequence[str] = (), progress: bool = True) -> ExtractReport:
    """Extract every (backbone, client, split) shard of `manifest` into `store`, as `embedcache
    extract`: complete shards with the same cache key are reused without touching an image, an
    interrupted run resumes from its missing chunks, changed images are refused or re-extracted.

    backbones: names (comma-separated or a list), e.g. "resnet20-cifar10,timm:resnet18"; "default"
        is the choice `embedcache backbones` prints. scheduler: None (this process), "local:N"
        (dask LocalCluster) or "tcp://HOST:PORT". cut: store the map after that block instead of
        the pooled feature. plugins: modules to import first (e.g. registering your backbones).
    Returns the report (shards, cache hits, chunks and images computed, seconds, notes)."""
    from embedcache.extraction import ExtractConfig
    from embedcache.extraction import extract as run

    if isinstance(manifest, (str, Path)) and not Path(manifest).is_file():
        raise UserError(f"{manifest}: manifest file not found")
    names = [b.strip() for b in backbones.split(",")] if isinstance(backbones, str) else list(backbones)
    expanded, said = expand_default([b for b in names if b], weights_dir)
    if said:
        print(f"backbones: {said}", file=sys.stderr, flush=True)
    cfg = ExtractConfig(backbones=expanded, store=str(store), device=device, batch_size=batch_size,
                        num_workers=num_workers, scheduler=scheduler, views=views, dtype=dtype,
                        weights_dir=weights_dir, chunk_rows=chunk_rows, plugins=tuple(plugins),
                        progress=progress, cut=cut)
    report = run(manifest, cfg)
    if said:
        report.notes.insert(0, f"backbones: {said}")
    return report


def open_store(store: str | Path, *, quiet: bool = False) -> StoreInfo:
    """The store's classes, clients and shards (N, D, backbone, complete, current), as
    `embedcache inspect`; reading features: :func:`load_split`."""
    from embedcache.store.reader import open_store as open_

    return open_(store, quiet=quiet)


def load_split(store: str | Path | StoreInfo, backbones: Sequence[str] | str, split: str,
               clients: Sequence[str] | None = None, views: bool = False) -> dict[str, ClientSplit]:
    """{client: ClientSplit(features [N, D] numpy, labels, sample_ids, domain)} of `split`, the
    backbones' features concatenated in order; every row checked against its recorded digests."""
    from embedcache.store.reader import load_split as load

    return load(store, backbones, split, clients=clients, views=views)


def import_features(source: str | Path, store: str | Path, *, backbone: str | None = None,
                    client: str | None = None, split: str | None = None, domain: str | None = None,
                    features_key: str = "features", labels_key: str = "labels", transpose: bool = False,
                    classes: Sequence[str] | None = None, dtype: str | None = None) -> list:
    """`embedcache import`: one file of arrays (give client and split), an `embedcache export`
    (.h5 or npz directory), an HDF5 file with a group per client, or a directory of per-client
    files, written into `store` all or nothing (docs/contracts.md 4a). Returns the ShardSpecs written."""
    from embedcache.store.importer import import_many

    return import_many(store, source, backbone=backbone, client=client, split=split, domain=domain,
                       features_key=features_key, labels_key=labels_key, transpose=transpose,
                       classes=classes, dtype=dtype)


def export(store: str | Path, out: str | Path, format: str = "h5") -> int:
    """`embedcache export`: every shard to one HDF5 file (`format="h5"`) or an npz directory
    (`"npz"`), rows exactly as stored; returns the number of shards."""
    from embedcache.store.export import export_store

    return export_store(store, out, format)
