"""The one-shot statistics message of the Gaussian heads (GH-OFL, FedCGS): sums over a client's
examples per class it holds and over all its examples, sent once.

Each client sends, for every class it holds, a few per-class sums ("items": A = Σ x, Q = Σ x ⊙ x,
S = Σ xxᵀ, as the algorithm asks) with the class label and count, and a few sums over all its
rows ("whole": the Gram B = Σ xxᵀ). `ClassItems` lays the items out as runs, one per client, so
what is counted is what a client sends (a client holding 3 of 100 classes sends 3 items, not
100); `ClassTotals` is the class-level sum of many clients' messages, which the vectorised
engine's summed path and SecAgg+ use (both dense: [C, ...] per field)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedheads.algorithms.fed3r import client_gram

MOMENTS = ("sums", "sumsq", "class_sq")  # the per-class sums an algorithm may ask for: x, x ⊙ x, x xᵀ


@dataclass(frozen=True)
class ClassItems:
    """Runs of (client, class) items: client i's run is items [start_i, start_i + pairs[i]) with
    start_i = pairs[:i].sum(), ascending classes. Two messages concatenated leaf by leaf are the
    message of their clients in order (core.tree.RaggedRows)."""

    pairs: torch.Tensor  # [M] int64 classes each client sends (0 once it has sent)
    fresh: torch.Tensor  # [M] int64 1: the client sends its statistics now
    classes: torch.Tensor  # [Q] int64 the class of each item
    counts: torch.Tensor  # [Q] int64 its count n_kc
    items: dict[str, torch.Tensor]  # {moment: [Q, ...] float64} per item
    whole: dict[str, torch.Tensor]  # {"gram": [M, D, D] float64} per client

    def client_rows(self, idx: torch.Tensor) -> ClassItems:
        """The runs of clients `idx`, in that order (rows taken, nothing computed on them)."""
        idx = idx.to(self.pairs.device)
        start = torch.cumsum(self.pairs, 0) - self.pairs
        n = self.pairs[idx]
        first = torch.cumsum(n, 0) - n
        item = torch.repeat_interleave(start[idx] - first, n) + torch.arange(int(n.sum()), device=n.device)
        return ClassItems(n, self.fresh[idx], self.classes[item], self.counts[item],
                          {k: v[item.to(v.device)] for k, v in self.items.items()},
                          {k: v[idx.to(v.device)] for k, v in self.whole.items()})

    def comm_size(self) -> tuple[int, int]:
        """(values, bytes) one client sends, averaged over the clients and rounded: its whole
        sums once, and per class it holds the items, its label and its count."""
        return sent_size(int(self.pairs.shape[0]), int(self.fresh.sum()), int(self.pairs.sum()),
                         {k: v.shape[1:] for k, v in self.items.items()}, {k: v.shape[1:] for k, v in self.whole.items()})

    def totals(self, num_classes: int) -> ClassTotals:
        """The class-level sums of these clients' items (one row)."""
        cls = self.classes.to(self.counts.device)
        n = torch.zeros(num_classes, dtype=torch.int64, device=cls.device).index_add_(0, cls, self.counts)
        items = {k: torch.zeros(num_classes, *v.shape[1:], dtype=torch.float64, device=v.device)
                 .index_add_(0, cls.to(v.device), v.to(torch.float64))[None] for k, v in self.items.items()}
        dev = n.device
        return ClassTotals(n[None], items, {k: v.to(torch.float64).sum(0, keepdim=True) for k, v in self.whole.items()},
                           self.fresh.sum().view(1).to(dev), self.pairs.sum().view(1).to(dev),
                           torch.tensor([self.pairs.shape[0]], dtype=torch.int64, device=dev))


@dataclass(frozen=True)
class ClassTotals:
    """Many clients' messages added, class by class: one row, with what the comm count needs."""

    counts: torch.Tensor  # [1, C] int64 N_c
    items: dict[str, torch.Tensor]  # {moment: [1, C, ...] float64}
    whole: dict[str, torch.Tensor]  # {"gram": [1, D, D] float64}
    clients: torch.Tensor  # [1] int64 clients that sent now
    pairs: torch.Tensor  # [1] int64 (client, class) items they sent
    rows: torch.Tensor  # [1] int64 participants summed

    def comm_size(self) -> tuple[int, int]:
        return sent_size(int(self.rows.sum()), int(self.clients.sum()), int(self.pairs.sum()),
                         {k: v.shape[2:] for k, v in self.items.items()}, {k: v.shape[1:] for k, v in self.whole.items()})


def sent_size(rows: int, clients: int, pairs: int, items: dict[str, torch.Size],
              whole: dict[str, torch.Size]) -> tuple[int, int]:
    """(values, bytes) per participant of `clients` senders' whole sums and `pairs` items (float64
    values; an item's label and count as two int64)."""
    per_item = sum(s.numel() for s in items.values())
    per_client = sum(s.numel() for s in whole.values())
    values = clients * per_client + pairs * (per_item + 2)
    m = max(rows, 1)
    return round(values / m), round(8 * values / m)


def class_items(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int, moments: Sequence[str],
                fresh: torch.Tensor, block_elems: int = 1 << 22) -> ClassItems:
    """The message of stacked clients x [M, N, D] (rows where `mask`), `moments` of MOMENTS per
    (client, class) item in (client, class) order and the Gram per client, float64; rows are
    added in order, a block at a time (the float64 copies and outer products stay small)."""
    M, N, D = x.shape
    C = num_classes
    key = torch.where(mask, torch.arange(M, device=x.device).view(M, 1) * C + y, torch.full_like(y, -1)).reshape(-1)
    rows = (key >= 0).nonzero().view(-1)
    keys, slot = torch.unique(key[rows], sorted=True, return_inverse=True)
    flat = x.reshape(M * N, D)
    shape = {"sums": (D,), "sumsq": (D,), "class_sq": (D, D)}
    items = {k: torch.zeros(len(keys), *shape[k], dtype=torch.float64, device=x.device) for k in moments}
    step = max(1, block_elems // (D * D if "class_sq" in items else D))
    for a in range(0, len(rows), step):
        xb, s = flat[rows[a:a + step]].to(torch.float64), slot[a:a + step]
        for k, t in items.items():
            t.index_add_(0, s, xb if k == "sums" else xb * xb if k == "sumsq" else xb.unsqueeze(2) * xb.unsqueeze(1))
    client = torch.div(keys, C, rounding_mode="floor")
    return ClassItems(torch.bincount(client, minlength=M), fresh.to(torch.int64), keys - client * C,
                      torch.bincount(slot, minlength=len(keys)), items, {"gram": client_gram(x, mask)})


def pooled_totals(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, num_classes: int, moments: Sequence[str],
                  fresh: torch.Tensor) -> ClassTotals:
    """class_items(...).totals(C) of the clients in x [M, N, D], from their rows pooled: no
    per-client Gram or item is made (the summed path)."""
    M, N, D = x.shape
    one = class_items(x.reshape(1, M * N, D), y.reshape(1, M * N), mask.reshape(1, M * N), num_classes, moments,
                      fresh.new_ones(1))
    tot = one.totals(num_classes)
    pairs = torch.unique((torch.arange(M, device=mask.device).view(M, 1) * num_classes + y)[mask]).numel()
    dev = tot.counts.device
    return ClassTotals(tot.counts, tot.items, tot.whole, fresh.sum().view(1).to(dev, torch.int64),
                       torch.tensor([pairs], dtype=torch.int64, device=dev), torch.tensor([M], dtype=torch.int64, device=dev))
