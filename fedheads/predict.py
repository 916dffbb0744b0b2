"""Batch prediction from a trained run: every client classifies its stored samples by its own
nearest prototype, with faiss (fedheads.inference), streaming the store in row chunks so memory
stays bounded whatever the number of samples.

An algorithm that classifies by prototypes exposes
    prototype_view(client_state, server_state, x [1,N,D]) -> (queries [1,N,d], prototypes [1,C,d],
                                                               present [1,C] bool, rule)
with `rule` one of fedheads.inference.RULES (FedPCL: inner product on its L2-normalised z, or
squared distance in the authors'-code variant; FedProto; FedNCM: cosine to the class means).
Algorithms without prototypes (FedAvg, LP, MLP, ...) fall back to their own classifier's argmax:
the same rule their evaluation uses, without faiss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from embedcache.errors import UserError
from embedcache.callable_module import make_callable
from fedheads import api, inference
from fedheads.algorithms import create_algorithm
from fedheads.core.tree import tree_index
from fedheads.data import DataSpec, resolve_device


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"{path}: missing (not a complete `fedheads train` run directory)")
    return json.loads(path.read_text())


def run_spec(store_info: Any, clients: list[str], backbones: list[str], num_classes: int,
             device: torch.device) -> DataSpec:
    """The DataSpec a run was trained with, from shard attributes alone (no feature read)."""
    from fedheads.runner import backbone_dims

    dim = sum(backbone_dims(store_info, backbones))
    n_train = []
    for c in clients:
        s = store_info.shard(backbones[0], c, "train")
        n_train.append(int(s.n) if s is not None else 0)
    return DataSpec(dim, num_classes, len(clients), tuple(n_train), device)


def _chunks(store: str, backbones: list[str], split: str, client: str, rows: int,
            ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    from embedcache.reader import iter_split_chunks

    yield from iter_split_chunks(store, backbones, split, client, chunk_rows=rows)


def predict_client(alg: Any, cs: Any, ss: Any, chunks: Any, k: int, device: torch.device,
                   binarize: bool) -> Iterator[tuple[np.ndarray, np.ndarray, inference.Predictions]]:
    """(sample_ids, labels, predictions) per chunk for one client (cs has a client axis of 1)."""
    view = getattr(alg, "prototype_view", None)
    for feats, labels, ids in chunks:
        x = torch.as_tensor(np.ascontiguousarray(feats), dtype=torch.float32, device=device).unsqueeze(0)
        if binarize:
            x = torch.sign(x)
        with torch.no_grad():
            if view is not None:
                q, protos, present, rule = view(cs, ss, x)
                pred = inference.predict_features(protos[0].cpu().numpy(), present[0].cpu().numpy(),
                                                  rule, q[0].cpu().numpy(), k=k)
            else:
                mask = torch.ones(x.shape[:2], dtype=torch.bool, device=device)
                scores = alg.predict(cs, ss, x, mask)["main"][0]
                top = torch.topk(scores, min(k, scores.shape[-1]), dim=-1, sorted=True)
                tl, ts = top.indices.cpu().numpy().astype(np.int64), top.values.cpu().numpy().astype(np.float32)
                if k > tl.shape[1]:
                    pad = k - tl.shape[1]
                    tl = np.pad(tl, ((0, 0), (0, pad)), constant_values=-1)
                    ts = np.pad(ts, ((0, 0), (0, pad)), constant_values=np.nan)
                pred = inference.Predictions(tl[:, 0].copy(), ts[:, 0].copy(), tl, ts)
        yield ids, labels, pred


def iter_predictions(run_dir: str | Path, store: str, split: str = "test", client: str = "all",
                     seed: int | None = None, k: int = 1, chunk_rows: int = 65536, device: str = "cpu",
                     ) -> Iterator[dict[str, np.ndarray]]:
    """Prediction tables (fedheads.inference.prediction_rows), one per chunk of `chunk_rows`
    rows of each wanted client; every check is done before the first table is yielded."""
    from embedcache.reader import open_store
    from fedheads.runner import load_state

    run_dir = Path(run_dir)
    results = _read_json(run_dir / "results.json")
    config = _read_json(run_dir / "config.json")
    backbones, clients = list(config["backbones"]), list(results["clients"])
    seed = int(results["seeds"][0]) if seed is None else seed
    if seed not in results["seeds"]:
        raise UserError(f"--seed {seed}: the run has seeds {results['seeds']}")
    if k < 1:
        raise UserError(f"--top-k {k}: must be >= 1")
    dev = resolve_device(device)
    info = open_store(store)
    from fedheads.runner import store_fingerprint

    trained = config.get("store_fingerprint")
    if trained is not None:
        now = store_fingerprint(info, backbones)
        if now["classes"] != trained["classes"]:
            raise UserError(f"{store}: class list differs from the training store's; predictions would be mislabelled")
        for b, fp in trained["backbones"].items():
            if now["backbones"][b] != fp:
                raise UserError(f"{store}: backbone {b} was extracted with other weights, preprocessing or "
                                f"dimension than in training; re-extract with the same backbone")
    wanted = clients if client == "all" else [client]
    for c in wanted:
        if c not in clients:
            raise UserError(f"--client {c}: not a client of this run (clients: {', '.join(clients)})")
        if info.shard(backbones[0], c, split) is None:
            raise UserError(f"{c}/{split}: not in store {store}")
    alg = create_algorithm(config["algorithm"], **config.get("algorithm_kwargs", {}))
    spec = run_spec(info, clients, backbones, int(results["num_classes"]), dev)
    cs_all, ss = load_state(run_dir / "state" / f"seed{seed}.pt", alg, spec, seed)
    binarize = bool(config.get("options", {}).get("binarize", False))

    def tables() -> Iterator[dict[str, np.ndarray]]:
        for c in wanted:
            i = torch.tensor([clients.index(c)], device=dev)
            cs = tree_index(cs_all, i)
            for ids, labels, pred in predict_client(alg, cs, ss, _chunks(store, backbones, split, c, chunk_rows),
                                                    k, dev, binarize):
                yield inference.prediction_rows(c, ids, labels, pred)

    return tables()


def predict_run(run_dir: str | Path, store: str, split: str = "test", client: str = "all",
                seed: int | None = None, k: int = 1, chunk_rows: int = 65536, device: str = "cpu",
                out: str | Path = "predictions.csv") -> int:
    """Write predictions for `client` (or all) of `split` to `out`; returns the row count."""
    count = 0

    def counted() -> Iterator[dict[str, np.ndarray]]:
        nonlocal count
        for t in iter_predictions(run_dir, store, split, client, seed, k, chunk_rows, device):
            count += len(t["label"])
            yield t

    inference.write_predictions(counted(), out)
    return count


# `fedheads.predict(...)` is the API function (fedheads.api.predict); this module stays importable
make_callable(__name__, api.predict)
