"""One chunk of one shard, decoded and embedded: the unit of work that the single-process
runner (`embedcache.extraction`) and dask workers (`embedcache.distributed`) both run, so a
resumed, a fresh and a distributed run write bitwise-identical stores.

A chunk always goes through the model in the same batches (batch b of a chunk holds rows
[start + b*B, start + (b+1)*B)), and augmented views use a per-sample seed. Text backbones
(modality "text", contract 3d) embed each sample's `text` from the manifest in the same chunks and
fixed batches (nothing to decode); token backbones (`minilm-l6-v2:32@layer.5`) also return the
[n, T] mask that the shard stores beside the T-major rows.
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from embedcache.store.writer import ShardSpec

_VIEW_SEED_LOCK = threading.Lock()  # global RNGs: one seeded augmentation at a time


@dataclass(frozen=True)
class ChunkJob:
    """One unit of work: a chunk of one shard. Picklable, so dask workers can run it."""

    store: str  # store directory
    spec: ShardSpec  # the shard (with its full row lists)
    chunk: int  # chunk index
    locators: tuple[str, ...]  # image locators of the chunk's rows
    source: Any  # the ImageSource (pickled to workers)
    weights_dir: str | None  # for create_backbone on workers
    device: str  # resolved device
    batch_size: int  # rows per forward pass
    plugins: tuple[str, ...] = ()  # modules to import before creating the backbone
    num_workers: int = 1  # decode threads on the worker
    factory: Callable[[str, str | None, str], Any] | None = None  # picklable; None: create_backbone
    texts: tuple[str, ...] = ()  # the chunk's texts, for a text backbone (then `locators` is empty)

    @property
    def n_rows(self) -> int:
        return len(self.texts) if self.texts else len(self.locators)


def view_seed(sample_id: str, view: int) -> int:
    """Per-sample, per-view seed: the same sample always gets the same augmentations."""
    digest = hashlib.sha256(f"{sample_id}\0{view}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def decode_sample(backbone: Any, source: Any, sample_id: str, locator: str,
                  views: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Load one image and preprocess it: the clean view plus V seeded augmented views."""
    try:
        img = source.load(locator)
        clean = backbone.transform(img, train=False)
        aug: list[torch.Tensor] = []
        if views > 1:
            for v in range(views):
                seed = view_seed(sample_id, v)
                # torchvision/timm augmentations draw from the global RNGs: seed them all,
                # one sample at a time, so the views do not depend on thread timing.
                with _VIEW_SEED_LOCK:
                    random.seed(seed)
                    np.random.seed(seed % 2**32)
                    torch.manual_seed(seed)
                    aug.append(backbone.transform(img, train=True))
    except UserError:
        raise
    except Exception as exc:  # PIL/decoder errors come in many types
        raise UserError(f"{sample_id} ({locator}): cannot read or preprocess image: {exc}") from None
    return clean, aug


def forward(backbone: Any, tensors: Sequence[torch.Tensor], expect_dim: int) -> np.ndarray:
    """One batch through the frozen backbone -> [B, D] float32."""
    try:
        batch = torch.stack(list(tensors))
    except RuntimeError as exc:
        raise UserError(f"{backbone.name}: preprocessed images differ in shape ({exc})") from None
    with torch.inference_mode():
        out = backbone.embed(batch)
    arr = out.detach().cpu().numpy().astype(np.float32, copy=False)
    if arr.shape != (len(tensors), expect_dim):
        raise UserError(f"{backbone.name}: embed() returned shape {arr.shape}, expected ({len(tensors)}, {expect_dim})")
    return arr


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """Fixed batches of a chunk of n rows (relative to the chunk start)."""
    return [(a, min(a + batch_size, n)) for a in range(0, n, batch_size)]


def embed_chunk(backbone: Any, items: Sequence[tuple[torch.Tensor, list[torch.Tensor]]], spec: ShardSpec,
                batch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Features (and views) of one chunk from its decoded rows, in the fixed batches."""
    feats, views = [], []
    for a, b in batch_bounds(len(items), batch_size):
        feats.append(forward(backbone, [items[i][0] for i in range(a, b)], spec.feature_dim))
        if spec.views > 1:
            views.append(np.stack([forward(backbone, [items[i][1][v] for i in range(a, b)], spec.feature_dim)
                                   for v in range(spec.views)]))
    f = np.concatenate(feats) if feats else np.zeros((0, spec.feature_dim), np.float32)
    return f, (np.concatenate(views, axis=1) if views else None)


def default_factory(name: str, weights_dir: str | None, device: str) -> Any:
    """create_backbone(name, weights_dir=..., device=...) (contract 3)."""
    from embedcache.backbones import create_backbone

    return create_backbone(name, weights_dir=weights_dir, device=device)


def is_text(backbone: Any) -> bool:
    return getattr(backbone, "modality", "image") == "text"


def embed_text_chunk(backbone: Any, texts: Sequence[str], spec: ShardSpec,
                     batch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Features (and, for token shards, the [n, T] mask) of one chunk of texts, in the fixed batches."""
    feats, masks = [], []
    for a, b in batch_bounds(len(texts), batch_size):
        with torch.inference_mode():
            out, mask = backbone.embed_texts(list(texts[a:b]))
        arr = out.detach().cpu().numpy().astype(np.float32, copy=False)
        if arr.shape != (b - a, spec.feature_dim):
            raise UserError(f"{backbone.name}: embed_texts() returned shape {arr.shape}, expected ({b - a}, {spec.feature_dim})")
        feats.append(arr)
        if spec.token_shape is not None:
            masks.append(mask.cpu().numpy().astype(np.bool_))
    f = np.concatenate(feats) if feats else np.zeros((0, spec.feature_dim), np.float32)
    if spec.token_shape is None:
        return f, None
    return f, (np.concatenate(masks) if masks else np.zeros((0, spec.token_shape[0]), np.bool_))
