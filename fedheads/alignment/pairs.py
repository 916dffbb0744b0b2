"""Paired (image, text) clients for FedDRA: live images and tokenised texts, cached token states
(stage-1 inputs), and every batch as a pure function of (seed, round, client, stage, ...).

Training batches (Alg. 2/3 line 5, "sample xi from D_i uniformly"): each local step takes B =
min(batch, n_i) distinct rows; epochs are seeded permutations (fedheads.core.rng) cut into whole
batches, so a batch never holds a sample twice (a duplicated pair would be its own negative in
InfoNCE) and E steps may span several epochs. Stage 2 augments each image under a seed of
(seed, round, client, step, row) (fedheads.finetuning.data.sample_seeds), independent of workers.

DRO batches (v_i, Alg. 1 line 14): a fixed set of batches per client, the same in every round, of
one size B_v for all clients (InfoNCE grows with log B, so a common B keeps v comparable).

Evaluation batches: the test split in a seeded order, cut into batches of exactly 64 (chance
1/64); the rows left over form a last batch made of the LAST 64 rows of the order, whose queries
already counted are not counted again, so every test sample is a query exactly once in a batch
of 64. A client with fewer than 64 test samples is one batch of all of them (chance 1/n).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.alignment import vl
from fedheads.core import rng
from fedheads.finetuning.data import ImageLoader, sample_seeds, shared_loader

EVAL_BATCH = 64
_TRAIN, _DRO, _EVAL = 0x5731, 0xD20, 0xE7A1


def _perm(n: int, *coords: int) -> np.ndarray:
    keys = rng.hash_keys(*coords, torch.arange(n))
    return torch.argsort(keys, stable=True).numpy()


def step_rows(n: int, client: int, batch: int, steps: int, seed: int, round_: int, stage: int) -> list[np.ndarray]:
    """Rows of each of the `steps` local steps (see the module docstring)."""
    if n < 1 or steps < 1:
        return []
    B = min(batch, n)
    per_epoch = n // B
    out: list[np.ndarray] = []
    for e in range(math.ceil(steps / per_epoch)):
        order = _perm(n, seed, round_, client, _TRAIN + stage, e)
        out += [order[k * B:(k + 1) * B] for k in range(per_epoch)]
    return out[:steps]


def dro_rows(n: int, client: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    """The fixed batches on which v_i is measured every round (size `batch` <= n)."""
    order = _perm(n, seed, client, _DRO)
    k = min(count, max(1, n // batch))
    return [order[j * batch:(j + 1) * batch] for j in range(k)]


def eval_batches(n: int, client: int, seed: int, batch: int = EVAL_BATCH) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rows, counted) per evaluation batch: `counted` marks the queries scored in that batch."""
    if n == 0:
        return []
    order = _perm(n, seed, client, _EVAL)
    if n <= batch:
        return [(order, np.ones(n, dtype=bool))]
    full = n // batch
    out = [(order[k * batch:(k + 1) * batch], np.ones(batch, dtype=bool)) for k in range(full)]
    rest = n - full * batch
    if rest:
        counted = np.zeros(batch, dtype=bool)
        counted[batch - rest:] = True
        out.append((order[n - batch:], counted))
    return out


@dataclass
class TokenCache:
    """Encoder outputs of one split (stage-1 inputs), made by the encoders of `version`
    (0: the pre-trained encoders; a re-encode during a run: an opaque token of that run and round)."""

    img: torch.Tensor  # [N, Ti, Di] float32
    img_mask: torch.Tensor | None  # [N, Ti] bool or None
    txt: torch.Tensor  # [N, Tt, Dt]
    txt_mask: torch.Tensor | None  # [N, Tt]
    version: Any = 0


@dataclass
class PairSplit:
    labels: torch.Tensor  # [N] int64
    texts: tuple[str, ...]
    ids: torch.Tensor  # [N, T] token ids
    mask: torch.Tensor  # [N, T] bool attention mask
    rows: np.ndarray  # rows of the federation's image dataset
    base: TokenCache | None = None  # the pre-trained encoders' token states (store or first encode)
    cache: TokenCache | None = None  # the latest re-encode within a run

    @property
    def n(self) -> int:
        return int(self.labels.numel())

    def cache_for(self, version: Any) -> TokenCache | None:
        """The token states made by the encoders of `version`, if held."""
        for c in (self.base, self.cache):
            if c is not None and c.version == version:
                return c
        return None

    def any_cache(self) -> TokenCache | None:
        return self.base if self.base is not None else self.cache


@dataclass
class PairBatch:
    """One batch: live inputs (images, ids/mask) and/or cached token states, on the device."""

    images: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    img_tok: torch.Tensor | None = None
    img_mask: torch.Tensor | None = None
    txt_tok: torch.Tensor | None = None
    txt_mask: torch.Tensor | None = None
    anchor: tuple[torch.Tensor, torch.Tensor] | None = None  # (z*x, z*y) of the frozen global model, precomputed


@dataclass
class PairClient:
    name: str
    index: int  # global client id: seeds its batches and augmentations
    domain: str
    train: PairSplit
    test: PairSplit
    images: ImageLoader = field(repr=False)

    @property
    def n_train(self) -> int:
        return self.train.n

    def split(self, name: str) -> PairSplit:
        return self.train if name == "train" else self.test

    def batches(self, split: str, rows: Sequence[np.ndarray], device: torch.device, *,
                img: TokenCache | None = None, txt: TokenCache | None = None,
                augment: tuple[int, int] | None = None,
                anchor: tuple[torch.Tensor, torch.Tensor] | None = None) -> Iterator[PairBatch]:
        """Batches of `rows`: image token states from `img` (else live images) and text token
        states from `txt` (else ids/mask for a live pass). `augment` = (seed, round): training
        views, else the evaluation transform. `anchor`: the global model's (z*x, z*y) of every
        row of the split (stage 1 from the cache: the same for all E steps of a round)."""
        sp = self.split(split)
        live_imgs: Iterator[torch.Tensor | None]
        if img is not None:
            live_imgs = iter([None] * len(rows))
        else:
            reqs = []
            for s, r in enumerate(rows):
                seeds = sample_seeds(r, self.index, augment[0], augment[1], s) if augment else np.full(len(r), -1)
                reqs.append([(int(sp.rows[i]), int(k)) for i, k in zip(r, seeds)])
            live_imgs = self.images.read(reqs, device)
        for r, x in zip(rows, live_imgs):
            idx = torch.as_tensor(np.asarray(r), dtype=torch.int64)
            b = PairBatch(images=x)
            if img is not None:
                b.img_tok = img.img.index_select(0, idx).to(device, non_blocking=True)
                b.img_mask = None if img.img_mask is None else img.img_mask.index_select(0, idx).to(device)
            if txt is not None:
                b.txt_tok = txt.txt.index_select(0, idx).to(device, non_blocking=True)
                b.txt_mask = None if txt.txt_mask is None else txt.txt_mask.index_select(0, idx).to(device)
            else:
                b.ids, b.mask = sp.ids.index_select(0, idx).to(device), sp.mask.index_select(0, idx).to(device)
            if anchor is not None:
                b.anchor = (anchor[0].index_select(0, idx.to(anchor[0].device)),
                            anchor[1].index_select(0, idx.to(anchor[1].device)))
            yield b


def check_paired(manifest: Any) -> None:
    """One line naming the first sample without a text."""
    for c in manifest.clients:
        for split in ("train", "test"):
            for s in getattr(c, split):
                if getattr(s, "text", None) is None:
                    raise UserError(f"{c.name}/{split}/{s.id}: no text; FedDRA trains on image-text pairs "
                                    "(partition a captioned source, e.g. captioned:imagefolder:PATH)")


def pair_clients(manifest: Any, source: Any, transform: Callable[..., torch.Tensor], text_bb: Any,
                 num_workers: int = 0, device: torch.device | None = None) -> list[PairClient]:
    """One PairClient per manifest client; texts tokenised once, images through ONE shared loader."""
    check_paired(manifest)
    loader, spans = shared_loader(manifest, source, transform, num_workers, device)
    out = []
    for i, (c, (tr, te)) in enumerate(zip(manifest.clients, spans)):
        if not c.train:
            raise UserError(f"{c.name}/train: no training samples")
        splits = []
        for samples, rows in ((c.train, tr), (c.test, te)):
            texts = tuple(s.text for s in samples)
            ids, mask = vl.tokenize(text_bb, texts) if texts else (torch.zeros(0, 1, dtype=torch.int64),
                                                                   torch.zeros(0, 1, dtype=torch.bool))
            splits.append(PairSplit(torch.tensor([s.label for s in samples], dtype=torch.int64), texts, ids,
                                    mask, rows))
        out.append(PairClient(c.name, i, c.domain, splits[0], splits[1], loader))
    return out


def cache_from_store(clients: Sequence[PairClient], manifest: Any, store: str, image_name: str,
                     text_name: str) -> None:
    """Fill every split's TokenCache (version 0) from the store's token shards."""
    names = [c.name for c in clients]
    for split in ("train", "test"):
        imgs = vl.read_tokens(store, image_name, split, names)
        txts = vl.read_tokens(store, text_name, split, names)
        for c, mc in zip(clients, manifest.clients):
            want = np.array([s.id for s in getattr(mc, split)], dtype=str)
            for nm, t in ((image_name, imgs[c.name]), (text_name, txts[c.name])):
                if not np.array_equal(np.asarray(t.sample_ids, dtype=str), want):
                    raise UserError(f"{store}: {nm}/{c.name}/{split} rows are not the manifest's samples in order; "
                                    "extract with this manifest")
            i, t = imgs[c.name], txts[c.name]
            c.split(split).base = TokenCache(i.tokens, i.mask, t.tokens, t.mask, 0)


@torch.no_grad()
def encode_cache(net: Any, clients: Sequence[PairClient], device: torch.device, version: Any,
                 splits: Sequence[str] = ("train", "test"), batch: int = EVAL_BATCH) -> int:
    """Encode the clients' data with the network's current (frozen, eval-mode) encoders; returns
    the number of samples encoded. Version 0 (pre-trained encoders) also fills `base`."""
    net.eval()
    done = 0
    for c in clients:
        for split in splits:
            sp = c.split(split)
            rows = [np.arange(a, min(a + batch, sp.n)) for a in range(0, sp.n, batch)]
            imgs, txts = [], []
            for b in c.batches(split, rows, device):
                imgs.append(net.image_tokens(b.images).float().cpu())
                txts.append(net.text_tokens(b.ids, b.mask).float().cpu())
            if imgs:
                sp.cache = TokenCache(torch.cat(imgs), None, torch.cat(txts), sp.mask.clone(), version)
                if version == 0 and sp.base is None:
                    sp.base = sp.cache
                done += sp.n
    return done
