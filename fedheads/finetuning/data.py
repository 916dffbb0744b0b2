"""Client batches for live fine-tuning, from live images or from the feature store, behind one
interface (`LiveClient`).

Batches: the same per-client seeded schedule as the head engines (fedheads.core.batching:
a counter-based hash of (seed, round, client global index, epoch, row) orders each epoch; the
last batch of an epoch is partial, never dropped), so a run is reproducible and a resumed run
sees exactly the batches it would have seen.

Live images: each client's samples are read through the manifest's `embedcache.sources`
source and the backbone's own preprocessing: its training augmentation for training
(`Backbone.transform(img, train=True)`, from the model's data config where it has one) and its
evaluation transform for testing. Every training sample is augmented under a seed that is a pure
function of (seed, round, client, epoch, row), applied inside `__getitem__`, so the augmented
pixels do not depend on the number of DataLoader workers or their timing.

Cached inputs (cache-first fine-tuning, FedNCM-paper FT with a frozen prefix): the activation
maps after the cut (`B@CUT` shards, reshaped to their `map_shape`) or the pooled features (`B`
shards), read once through `embedcache.store.reader`; no augmentation (the maps were computed from the
evaluation transform).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.core import rng
from fedheads.core.batching import make_schedule

EVAL_BATCH = 64  # = embedcache extract's default batch: round-0 live features match the cache


def epoch_batches(n: int, client_index: int, batch_size: int, epochs: int, seed: int,
                  round_: int) -> list[np.ndarray]:
    """Row indices of every local step of one client in one round (core.batching's schedule)."""
    if n == 0:
        return []
    s = make_schedule([n], torch.tensor([client_index]), batch_size, epochs, seed, round_)
    return [s.index[i, 0][s.valid[i, 0]].numpy() for i in range(s.num_steps)]


def sample_seeds(rows: np.ndarray, client_index: int, seed: int, round_: int, step: int) -> np.ndarray:
    """Augmentation seed of each row of one step (independent of workers and batch position)."""
    keys = rng.hash_keys(seed, round_, client_index, step, torch.as_tensor(rows, dtype=torch.int64), 0xA06)
    return keys.numpy()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch, python `random` and numpy (torchvision and timm transforms draw from all three)
    and restore their states afterwards, so the caller's random streams are untouched."""
    t_state, p_state, n_state = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(int(seed))
    random.seed(int(seed))
    np.random.seed(int(seed) % 2**32)
    try:
        yield
    finally:
        torch.random.set_rng_state(t_state)
        random.setstate(p_state)
        np.random.set_state(n_state)


def _one_thread(_: int) -> None:
    """Decode workers use one torch thread each: the training process owns the cores, and
    several multi-threaded workers on a 2-core machine would fight it (and each other)."""
    torch.set_num_threads(1)


class _Images(torch.utils.data.Dataset):
    """Every live image of the federation; items are (row, augmentation seed or -1 for the
    evaluation transform)."""

    def __init__(self, source: Any, locators: Sequence[str], transform: Callable[..., torch.Tensor]) -> None:
        self.source, self.locators, self.transform = source, list(locators), transform

    def __len__(self) -> int:
        return len(self.locators)

    def __getitem__(self, item: tuple[int, int]) -> torch.Tensor:
        row, aug_seed = item
        img = self.source.load(self.locators[row])  # UserError naming the locator if missing/corrupt
        if aug_seed < 0:
            return self.transform(img, train=False)
        with seeded(aug_seed):
            return self.transform(img, train=True)


class _Batches(torch.utils.data.Sampler):
    """The batches of the next pass; set by the client about to read (main process only)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class ImageLoader:
    """ONE DataLoader for all clients (its worker processes persist across clients and rounds:
    a loader per client would fork workers for every client in every round); each read sets
    the batches it wants."""

    def __init__(self, ds: _Images, num_workers: int, pin_memory: bool) -> None:
        self.sampler = _Batches()
        self.loader = torch.utils.data.DataLoader(
            ds, batch_sampler=self.sampler, num_workers=num_workers, pin_memory=pin_memory,
            persistent_workers=num_workers > 0, worker_init_fn=_one_thread if num_workers > 0 else None,
            # its own generator: starting an epoch draws a base seed, which from torch's global stream
            # would shift the model's dropout draws, so live and cache-first runs would differ
            generator=torch.Generator())

    def read(self, batches: list[list[tuple[int, int]]], device: torch.device) -> Iterator[torch.Tensor]:
        self.sampler.batches = batches
        for x in self.loader:
            yield x.to(device, non_blocking=True)


@dataclass
class LiveClient:
    """One client's training and test data as batches on a device.

    `x_train`/`x_test` are tensors (cached inputs) or None (live images through `images`, rows
    `train_rows` / `test_rows` of the shared loader's dataset)."""

    name: str  # client name (manifest / store)
    index: int  # global client id: seeds its batches and augmentations
    domain: str
    y_train: torch.Tensor  # [N] int64
    y_test: torch.Tensor  # [T] int64
    x_train: torch.Tensor | None = None  # [N, ...] cached maps / features, or None for live images
    x_test: torch.Tensor | None = None
    images: ImageLoader | None = None  # the federation's shared image loader
    train_rows: np.ndarray | None = None  # rows of this client's training images in the loader's dataset
    test_rows: np.ndarray | None = None
    augment: bool = True  # live images: training augmentation on

    @property
    def n_train(self) -> int:
        return int(self.y_train.numel())

    @property
    def n_test(self) -> int:
        return int(self.y_test.numel())

    def train_batches(self, seed: int, round_: int, batch_size: int, epochs: int,
                      device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The round's local steps: (x, y) on `device`."""
        steps = epoch_batches(self.n_train, self.index, batch_size, epochs, seed, round_)
        if self.x_train is not None:
            for rows in steps:
                idx = torch.as_tensor(rows)
                yield (self.x_train.index_select(0, idx).to(device, non_blocking=True),
                       self.y_train.index_select(0, idx).to(device, non_blocking=True))
            return
        assert self.images is not None and self.train_rows is not None
        batches = []
        for s, rows in enumerate(steps):
            seeds = sample_seeds(rows, self.index, seed, round_, s) if self.augment else np.full(len(rows), -1)
            batches.append([(int(self.train_rows[r]), int(k)) for r, k in zip(rows, seeds)])
        for x, rows in zip(self.images.read(batches, device), steps):
            yield x, self.y_train.index_select(0, torch.as_tensor(rows)).to(device, non_blocking=True)

    def test_batches(self, device: torch.device,
                     batch_size: int = EVAL_BATCH) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The test split in order, in fixed batches (evaluation transform)."""
        n = self.n_test
        spans = [(a, min(a + batch_size, n)) for a in range(0, n, batch_size)]
        if self.x_test is not None:
            for a, b in spans:
                yield self.x_test[a:b].to(device, non_blocking=True), self.y_test[a:b].to(device, non_blocking=True)
            return
        assert self.images is not None and self.test_rows is not None
        batches = [[(int(self.test_rows[r]), -1) for r in range(a, b)] for a, b in spans]
        for x, (a, b) in zip(self.images.read(batches, device), spans):
            yield x, self.y_test[a:b].to(device, non_blocking=True)


def shared_loader(manifest: Any, source: Any, transform: Callable[..., torch.Tensor], num_workers: int = 0,
                  device: torch.device | None = None) -> tuple[ImageLoader, list[tuple[np.ndarray, np.ndarray]]]:
    """ONE loader over every client's train then test images (one worker pool for the whole run),
    and each client's (train rows, test rows) in it, in manifest order."""
    locators: list[str] = []
    spans = []
    for c in manifest.clients:
        tr = np.arange(len(locators), len(locators) + len(c.train))
        locators += [s.locator for s in c.train]
        te = np.arange(len(locators), len(locators) + len(c.test))
        locators += [s.locator for s in c.test]
        spans.append((tr, te))
    loader = ImageLoader(_Images(source, locators, transform), num_workers,
                         pin_memory=device is not None and device.type == "cuda")
    return loader, spans


def image_clients(manifest: Any, source: Any, transform: Callable[..., torch.Tensor], num_workers: int = 0,
                  augment: bool = True, device: torch.device | None = None) -> list[LiveClient]:
    """One LiveClient per manifest client, reading its images live through one shared loader."""
    loader, spans = shared_loader(manifest, source, transform, num_workers, device)
    return [LiveClient(c.name, i, c.domain, torch.tensor([s.label for s in c.train], dtype=torch.int64),
                       torch.tensor([s.label for s in c.test], dtype=torch.int64), images=loader,
                       train_rows=tr, test_rows=te, augment=augment)
            for i, (c, (tr, te)) in enumerate(zip(manifest.clients, spans))]


def cached_clients(store: str, name: str, clients: Sequence[str], domains: Sequence[str],
                   shape: Sequence[int] | None) -> list[LiveClient]:
    """One LiveClient per client from the store shards of `name` (`B@CUT` maps reshaped to
    `shape`, or `B` pooled features when shape is None)."""
    from embedcache.store.reader import load_split

    train = load_split(store, [name], "train", clients=list(clients))
    test = load_split(store, [name], "test", clients=list(clients))
    out = []
    for i, (c, dom) in enumerate(zip(clients, domains)):
        def as_x(feats: np.ndarray) -> torch.Tensor:
            x = torch.from_numpy(feats)
            return x if shape is None else x.view(x.shape[0], *shape)
        if train[c].features.shape[0] == 0:
            raise UserError(f"{name}/{c}/train: no training samples")
        out.append(LiveClient(c, i, dom, torch.from_numpy(train[c].labels), torch.from_numpy(test[c].labels),
                              x_train=as_x(train[c].features), x_test=as_x(test[c].features)))
    return out
