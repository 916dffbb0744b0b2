"""A synthetic feature store with the shape of iNaturalist-Users-120K, deterministic from a seed.

Clients: the exact training sizes of the real federation (embedcache.federation_shapes:
9,275 clients, 120,293 training rows, median 2, largest 2,511), in a seeded order; `clients=M`
takes M sizes at the shape's quantiles instead (a smaller federation of the same skew).
Test rows: the real central test set's 35,637 rows dealt out to the clients, at least one each
and the rest in proportion to their training sizes (largest remainder), so that every client can
be evaluated, as `fedheads train` evaluates per client.
Labels: 1,203 classes with a long-tailed prior p_c ~ 1 / (c + 1)^zipf (seeded class order),
skewed per client: client k draws its class proportions q_k ~ Dirichlet(alpha * C * p) (Hsu et al.
2019, "Measuring the Effects of Non-Identical Data Distribution", Section 3, with the prior as the
Dirichlet's mean) and every row of its train and test splits from q_k.
Features: 1280-d float32, x = mu_y + eps, class means mu_c ~ N(0, separation^2 I), eps ~ N(0, I),
so heads have something to learn: the true class means classify almost every row, and a head
estimated from the federation is held back by the tail classes' few rows.

The store is a real embedcache store (contract 4): the same shard groups, arrays, digests and
attributes as `embedcache.store.write_shard` writes, but every shard written in one pass with the
digests computed from memory rather than by `write_shard`'s lock/prepare/write/re-read cycle
per shard, and clients written concurrently (zarr's asyncio API) in worker processes, each
client's noise from its own seeded stream. tests/test_inat_store.py checks that
both writers give the same shard. Built into a cache directory keyed by the arguments; a build
that did not finish is removed and rebuilt.

Usage: python benchmarks/inat_store.py [--clients M] [--seed 0] [--cache-dir DIR]  (prints the store path)
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from zarr.core.sync import sync as zsync

from embedcache.federation_shapes import draw_sizes, load_shape
from embedcache.store import writer as S
from embedcache.store.checked_reads import chunk_digest, rows_digest
from embedcache.store.layout import backbone_key, consolidate, quiet_open

BACKBONE = "synthetic"
BATCH = 64  # clients written concurrently
PART = 500  # clients per worker task
DONE = "BUILT.json"  # written last: a cache directory without it is an interrupted build


@dataclass(frozen=True)
class InatConfig:
    """What the store is built from (the cache key)."""

    seed: int = 0
    shape: str = "inaturalist-users-120k"  # a name in embedcache.federation_shapes.SHAPES (or a CSV path)
    clients: int | None = None  # None: the shape's own clients, exactly
    test_rows: int = 35637  # the real federation's central test set, dealt out to the clients (scaled with M)
    classes: int = 1203
    dim: int = 1280
    zipf: float = 1.0  # long tail of the class prior p_c ~ 1 / (c + 1)^zipf
    alpha: float = 0.1  # per-client Dirichlet concentration (times C * p): smaller is more skewed
    separation: float = 0.15  # std of the class means per dimension (noise std 1)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Federation:
    """Row counts and labels of every client, in store order."""

    names: list[str]
    n_train: np.ndarray  # [M]
    n_test: np.ndarray  # [M]
    y_train: list[np.ndarray]
    y_test: list[np.ndarray]


def test_sizes(n_train: np.ndarray, total: int) -> np.ndarray:
    """One test row per client, the rest of `total` in proportion to the training sizes (largest remainder)."""
    m = len(n_train)
    rest = max(total - m, 0)
    share = rest * n_train / n_train.sum()
    out = np.floor(share).astype(np.int64)
    left = rest - int(out.sum())
    out[np.argsort(-(share - out), kind="stable")[:left]] += 1
    return out + 1


def federation(cfg: InatConfig, rng: np.random.Generator) -> Federation:
    """Client sizes and labels, vectorised over all rows (a flat searchsorted over the clients' CDFs)."""
    shape = load_shape(cfg.shape)
    n_train = draw_sizes(shape, cfg.clients)[rng.permutation(cfg.clients or len(shape))]
    total_test = cfg.test_rows if cfg.clients is None else max(1, round(cfg.test_rows * len(n_train) / len(shape)))
    n_test = test_sizes(n_train, total_test)
    m, c = len(n_train), cfg.classes
    prior = 1.0 / (np.arange(c) + 1.0) ** cfg.zipf
    prior = (prior / prior.sum())[rng.permutation(c)]
    q = rng.gamma(cfg.alpha * c * prior, size=(m, c))  # Dirichlet(alpha * C * p) rows, unnormalised
    s = q.sum(axis=1, keepdims=True)
    q = np.where(s > 0, q / np.where(s > 0, s, 1.0), prior)  # all-underflow rows (never seen): the prior
    cdf = np.cumsum(q, axis=1) + np.arange(m)[:, None]  # client k's CDF shifted into [k, k + 1]: one sorted array
    flat = cdf.ravel()

    def labels(n: np.ndarray) -> list[np.ndarray]:
        owner = np.repeat(np.arange(m), n)
        idx = np.searchsorted(flat, owner + rng.random(len(owner)), side="right") - owner * c
        return np.split(np.minimum(idx, c - 1).astype(np.int64), np.cumsum(n)[:-1])

    width = len(str(m - 1))
    return Federation([f"u{k:0{width}d}" for k in range(m)], n_train, n_test, labels(n_train), labels(n_test))


async def _write_shard(cgroup, spec: S.ShardSpec, feats: np.ndarray) -> None:
    """One complete shard as store._create + write_chunk + finalize_shard leave it (same arrays,
    digests and attributes, the attributes last), without the per-shard locking and re-reading."""
    d, cr = spec.feature_dim, spec.chunk_rows
    labels = np.asarray(spec.labels, dtype=np.int64)
    ids = np.asarray(spec.sample_ids, dtype=str)
    key = spec.key
    chunks = [spec.rows(i) for i in range(spec.n_chunks)]
    digests = [chunk_digest(key, feats[a:b], None) for a, b in chunks]
    done = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(len(digests), 32)
    shard = await cgroup.create_group(spec.split)
    arrays = [shard.create_array("features", data=feats, chunks=(cr, d), fill_value=0),
              shard.create_array("labels", data=labels, chunks=(max(cr, 1),), fill_value=0),
              shard.create_array("sample_ids", shape=ids.shape, chunks=(max(cr, 1),), dtype=str),
              shard.create_array("done", data=done, chunks=(1, 32), fill_value=0)]
    made = await asyncio.gather(*arrays)
    if len(ids):
        await made[2].setitem(slice(None), ids)
    await shard.update_attributes({**S._shard_attrs(spec), "chunk_sha256": [g.hex() for g in digests],
                                   "rows_sha256": [rows_digest(key, labels[a:b], spec.sample_ids[a:b]).hex()
                                                   for a, b in chunks],
                                   "complete": True})


async def _write_clients(bgroup, items: list[tuple[str, list[tuple[S.ShardSpec, np.ndarray]]]]) -> None:
    """Several clients' groups and shards at once (zarr's I/O overlaps across them)."""

    async def one(name: str, shards: list[tuple[S.ShardSpec, np.ndarray]]) -> None:
        cgroup = await bgroup.create_group(name, attributes={"domain": shards[0][0].domain})
        await asyncio.gather(*(_write_shard(cgroup, spec, x) for spec, x in shards))

    await asyncio.gather(*(one(name, shards) for name, shards in items))


def spec_for(client: str, split: str, labels: np.ndarray, dim: int, manifest: str) -> S.ShardSpec:
    return S.ShardSpec(backbone=BACKBONE, weights_sha256="0" * 64, preprocess={}, feature_dim=dim, client=client,
                       split=split, domain="inat-synthetic", manifest_hash=manifest,
                       sample_list_hash=f"{manifest}-{client}-{split}",
                       sample_ids=tuple(f"{client}/{split}/{i}" for i in range(len(labels))),
                       labels=tuple(int(v) for v in labels))


def _write_range(path: str, bk: str, cfg: InatConfig, manifest: str, means: np.ndarray,
                 clients: list[tuple[int, str, np.ndarray, np.ndarray]]) -> None:
    """Write clients (index, name, train labels, test labels); client k's noise comes from its own
    stream (seed, k), so the store is the same whatever the number of workers."""
    bgroup = quiet_open(path, "r+", use_consolidated=False)[bk]
    for start in range(0, len(clients), BATCH):
        batch = []
        for k, name, y_tr, y_te in clients[start:start + BATCH]:
            rng = np.random.default_rng([cfg.seed, k])
            batch.append((name, [(spec_for(name, split, y, cfg.dim, manifest),
                                  means[y] + rng.standard_normal((len(y), cfg.dim), dtype=np.float32))
                                 for split, y in (("train", y_tr), ("test", y_te))]))
        zsync(_write_clients(bgroup._async_group, batch))


def write(path: Path, cfg: InatConfig, workers: int = 1, progress: bool = False) -> dict:
    """Build the store at `path` (which must not exist) with `workers` processes; returns its facts."""
    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    fed = federation(cfg, rng)
    means = rng.standard_normal((cfg.classes, cfg.dim), dtype=np.float32) * np.float32(cfg.separation)
    manifest = f"inat-synthetic-{cfg.key()}"
    S.init_store(path, [f"class{c:04d}" for c in range(cfg.classes)], manifest, clients=fed.names,
                 source=f"synthetic {cfg.shape}")
    root = quiet_open(path, "r+", use_consolidated=False)
    bk = backbone_key(BACKBONE)
    root.create_group(bk, attributes={"backbone": BACKBONE, "weights_sha256": "0" * 64, "preprocess": {},
                                      "feature_dim": cfg.dim})
    items = [(k, name, fed.y_train[k], fed.y_test[k]) for k, name in enumerate(fed.names)]
    parts = [items[i:i + PART] for i in range(0, len(items), PART)]
    workers = max(1, min(workers, len(parts)))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 else nullcontext() as pool:
        for i, part in enumerate(parts if pool is None else
                                 [pool.submit(_write_range, str(path), bk, cfg, manifest, means, p) for p in parts]):
            if pool is None:
                _write_range(str(path), bk, cfg, manifest, means, part)
            else:
                part.result()
            if progress:
                print(f"  {min((i + 1) * PART, len(items))}/{len(items)} clients, {time.perf_counter() - t0:.0f} s",
                      flush=True)
    consolidate(path)
    rows = int(fed.n_train.sum() + fed.n_test.sum())
    return {"config": asdict(cfg), "clients": len(fed.names), "train_rows": int(fed.n_train.sum()),
            "test_rows": int(fed.n_test.sum()), "train_rows_median": float(np.median(fed.n_train)),
            "train_rows_max": int(fed.n_train.max()),
            "classes_present_train": int(len(np.unique(np.concatenate(fed.y_train)))),
            "feature_bytes": rows * cfg.dim * 4, "train_feature_bytes": int(fed.n_train.sum()) * cfg.dim * 4,
            "build_seconds": round(time.perf_counter() - t0, 1), "build_workers": workers}


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedfrozen-bench"


def build(cfg: InatConfig, cache_dir: str | Path | None = None, workers: int | None = None,
          progress: bool = False) -> tuple[Path, dict]:
    """(store path, facts): the cached store of `cfg`, built first when missing or unfinished."""
    d = Path(cache_dir or default_cache()) / f"inat-{cfg.key()}"
    done = d / DONE
    if done.is_file():
        return d / "store.zarr", json.loads(done.read_text())
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    facts = write(d / "store.zarr", cfg, workers or len(os.sched_getaffinity(0)), progress)
    tmp = d / (DONE + ".tmp")
    tmp.write_text(json.dumps(facts, indent=2) + "\n")
    os.replace(tmp, done)
    return d / "store.zarr", facts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=None, help="M sizes at the shape's quantiles (default: all 9,275)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None, help="writer processes (default: the usable cores)")
    ap.add_argument("--cache-dir", default=None, help=f"default {default_cache()}")
    a = ap.parse_args()
    path, facts = build(InatConfig(seed=a.seed, clients=a.clients), a.cache_dir, a.workers, progress=True)
    print(json.dumps(facts, indent=2))
    print(path)


if __name__ == "__main__":
    main()
