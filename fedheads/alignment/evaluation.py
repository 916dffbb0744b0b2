"""FedDRA evaluation: in-domain image-text retrieval per client (Table 2's Rec/Wst, Table 9's
disparity, Table 10's per-client values) and the few-shot linear probe (Table 2's "cls." columns).

Retrieval (FedDRA App. A.1.2): "for each text in a batch of image-text pairs, we calculate
similarities with images in the batch, then rank these similarities and retrieve the top-1 and
top-5 images". The batch size is not stated ([R] fixed, seeded batches of 64: chance 1/64, see
fedheads.alignment.pairs.eval_batches). Reported per client, in percent:
  t2i_r1/r5   text -> image (the paper's metric; per_client in results.json is t2i_r1)
  i2t_r1/r5   image -> text
  cap_t2i_r*/cap_i2t_r*   caption level: a hit when a top-k candidate has the query's exact
              caption (captions repeat: the FedDRA notes' offline setting has 1,648 distinct
              captions for 2,533 images)
  class_r*    a class-only baseline: the expected text -> image R@k of a retriever that knows
              only the class and ranks the batch's images of that class first, in random order
              (min(1, k / m) with m same-class images in the batch): captions derive from the class
  chance_r*   k / B
Ranks break exact ties by batch position (stable sort). Across clients: mean, worst (min) and
disparity (max - min, [R] Table 9 leaves it undefined) of t2i_r1.

Few-shot probe ([R] MGCA-style, encoder frozen): k labelled images per class drawn from the
out-of-distribution set's training rows (several seeded draws), a linear head trained with
fedheads' `lp` algorithm (one client = centralised) on L2-normalised features, accuracy on its
test rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from embedcache.errors import UserError
from fedheads.core import rng

METRICS = ("t2i_r1", "t2i_r5", "i2t_r1", "i2t_r5", "cap_t2i_r1", "cap_t2i_r5", "cap_i2t_r1", "cap_i2t_r5",
           "class_r1", "class_r5", "chance_r1", "chance_r5")


@torch.no_grad()
def retrieval(zx: torch.Tensor, zy: torch.Tensor, texts: Sequence[str], labels: torch.Tensor,
              batches: Sequence[tuple[np.ndarray, np.ndarray]], ks: Sequence[int] = (1, 5)) -> dict[str, float]:
    """Per-client retrieval (fractions in [0, 1]) over the evaluation batches; NaN when empty."""
    zx = F.normalize(zx.float().cpu(), dim=-1)
    zy = F.normalize(zy.float().cpu(), dim=-1)
    cap = np.unique(np.asarray(texts, dtype=object), return_inverse=True)[1] if len(texts) else np.zeros(0, int)
    names = [f"{p}_r{k}" for p in ("t2i", "i2t", "cap_t2i", "cap_i2t", "class", "chance") for k in ks]
    sums = {m: 0.0 for m in names}
    n = 0
    for rows, counted in batches:
        idx = torch.as_tensor(rows, dtype=torch.int64)
        S = zy[idx] @ zx[idx].T  # texts (rows) x images (columns)
        B = len(rows)
        c = torch.as_tensor(cap[rows])
        lab = labels.cpu()[idx]
        keep = torch.as_tensor(counted)
        for name, sim in (("t2i", S), ("i2t", S.T)):
            order = torch.argsort(-sim, dim=1, stable=True)
            pos = (order == torch.arange(B)[:, None]).float().argmax(1)  # rank of the true partner
            same_cap = c[order] == c[:, None]
            for k in ks:
                sums[f"{name}_r{k}"] += float((pos < k)[keep].sum())
                sums[f"cap_{name}_r{k}"] += float(same_cap[:, :k].any(1)[keep].sum())
        m = (lab[:, None] == lab[None, :]).sum(1).double()
        for k in ks:
            sums[f"class_r{k}"] += float(torch.clamp(k / m, max=1.0)[keep].sum())
            sums[f"chance_r{k}"] += float(keep.sum()) * min(1.0, k / B)
        n += int(keep.sum())
    return {m: (v / n if n else float("nan")) for m, v in sums.items()}


def across_clients(per_client: Sequence[Mapping[str, float]], key: str = "t2i_r1") -> dict[str, float]:
    """mean / worst / best / disparity of one metric over the clients with test samples."""
    vals = np.array([p[key] for p in per_client if p[key] == p[key]], dtype=float)
    if vals.size == 0:
        return {"mean": float("nan"), "worst": float("nan"), "best": float("nan"), "disparity": float("nan")}
    return {"mean": float(vals.mean()), "worst": float(vals.min()), "best": float(vals.max()),
            "disparity": float(vals.max() - vals.min())}


# ------------------------------------------------------------------ few-shot linear probe
def shot_rows(labels: np.ndarray, shots: int, seed: int, draw: int) -> np.ndarray:
    """`shots` rows per class (all of a class that has fewer), a seeded draw."""
    keys = rng.hash_keys(seed, draw, shots, torch.arange(len(labels)), 0x5407).numpy()
    out = []
    for c in np.unique(labels):
        rows = np.nonzero(labels == c)[0]
        out.append(rows[np.argsort(keys[rows], kind="stable")[:shots]])
    return np.sort(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


def few_shot_probe(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray, *,
                   num_classes: int, shots: Sequence[int] = (1, 5), draws: int = 5, seed: int = 0,
                   rounds: int = 100, lp_settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Accuracy (%) of a linear probe per k-shot setting: {"k": {"mean", "std", "values"}}."""
    from fedheads.algorithms import create_algorithm
    from fedheads.core.engine import run
    from fedheads.run.load import from_arrays

    if len(y_test) == 0 or len(y_train) == 0:
        raise UserError("few-shot probe: the probe manifest needs training and test samples")

    def norm(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    xtr, xte = norm(x_train), norm(x_test)
    out: dict[str, Any] = {}
    for k in shots:
        accs = []
        for d in range(draws):
            rows = shot_rows(np.asarray(y_train), int(k), seed, d)
            data = from_arrays([(xtr[rows], np.asarray(y_train)[rows], xte, np.asarray(y_test))],
                                       num_classes, client_names=["probe"], device="cpu")
            alg = create_algorithm("lp", **dict(lp_settings or {}))
            res = run(alg, data, rounds, seed=seed + d, progress=False)
            accs.append(100.0 * float(res.final_accuracy("main")[0]))
        out[str(k)] = {"mean": float(np.mean(accs)), "std": float(np.std(accs, ddof=1)) if len(accs) > 1 else 0.0,
                       "values": accs}
    return out
