"""Batch prediction from a trained run (docs/contracts.md, 6c): every sample is classified by its
own client's state (nearest prototype with faiss, fedheads.prediction.prototypes) or, for images that belong
to no client, by the run's global model; features are streamed in row chunks, so memory stays
bounded whatever the number of samples.

An algorithm that classifies by prototypes exposes
    prototype_view(client_state, server_state, x [1,N,D]) -> (queries [1,N,d], prototypes [1,C,d],
                                                               present [1,C] bool, rule)
with `rule` one of fedheads.prediction.prototypes.RULES (FedPCL: inner product on its L2-normalised z, or
squared distance in the authors'-code variant; FedProto; FedNCM: cosine to the class means).
Algorithms without prototypes (FedAvg, LP, MLP, ...) fall back to their own classifier's top-k:
the same rule their evaluation uses, without faiss. The global model is the algorithm's
`global_rule` (fedheads.core.protocol).

Features of new images (`--images`, `--manifest`) are extracted by fedheads.prediction.inputs
(the only part that touches images); this module reads stores and run directories only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedcache.errors import UserError
from fedheads.core.tree import tree_index
from fedheads.prediction import prototypes as inference
from fedheads.prediction.trained import Part, note
from fedheads.run.commands import Predict
from fedheads.run.identity import mismatch
from fedheads.run.saved import Trained, open_run

GLOBAL = "(global)"  # the client column of rows classified by the global model (not a valid client name)


def check_store(tr: Trained, store: str, info: Any) -> None:
    """The store's classes and backbones are the ones the run was trained on (one line if not)."""
    from fedheads.run.train import store_fingerprint

    if tr.fingerprint is None:
        return  # trained from numpy arrays: nothing recorded to compare
    now = store_fingerprint(info, tr.backbones)
    if now["classes"] != tr.fingerprint["classes"]:
        raise UserError(f"{store}: class list differs from the training store's; predictions would be mislabelled")
    for b, fp in tr.fingerprint["backbones"].items():
        msg = mismatch(b, fp, now["backbones"][b])
        if msg:
            raise UserError(f"{store}: {msg}; re-extract with the training run's backbone")


def classifier(tr: Trained, client: str | None) -> tuple[Any, str]:
    """(client state with a client axis of 1, predict key) classifying as `client` (None: global)."""
    if client is None:
        rule = tr.alg.global_rule
        if rule is None:
            raise UserError(f"{tr.alg.name} has no global model (each client classifies with its own head or "
                            f"prototypes): give --client NAME (one of {', '.join(tr.clients)}) or --client all")
        i = 0  # the global rule reads the server state only
    else:
        rule, i = "main", tr.client_index(client)
    return tree_index(tr.client_state, torch.tensor([i], device=tr.device)), rule


def classify(tr: Trained, cs: Any, rule: str, feats: np.ndarray, k: int) -> inference.Predictions:
    """Top-k predictions of one chunk of features [n, D] by one classifier."""
    x = torch.as_tensor(np.ascontiguousarray(feats), dtype=torch.float32, device=tr.device).unsqueeze(0)
    if tr.binarize:
        x = torch.sign(x)
    alg, ss = tr.alg, tr.server_state
    with torch.no_grad():
        view = alg.prototype_view(cs, ss, x) if rule == "main" else None
        if view is not None:
            q, protos, present, how = view
            return inference.predict_features(protos[0].cpu().numpy(), present[0].cpu().numpy(), how,
                                              q[0].cpu().numpy(), k=k)
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        scores = alg.predict(cs, ss, x, mask)[rule][0]
        top = torch.topk(scores, min(k, scores.shape[-1]), dim=-1, sorted=True)
        tl, ts = top.indices.cpu().numpy().astype(np.int64), top.values.cpu().numpy().astype(np.float32)
    if k > tl.shape[1]:
        pad = k - tl.shape[1]
        tl = np.pad(tl, ((0, 0), (0, pad)), constant_values=-1)
        ts = np.pad(ts, ((0, 0), (0, pad)), constant_values=np.nan)
    return inference.Predictions(tl[:, 0].copy(), ts[:, 0].copy(), tl, ts)


def capped_k(k: int, num_classes: int) -> int:
    if k < 1:
        raise UserError(f"--top-k {k}: must be >= 1")
    if k > num_classes:
        note(f"--top-k {k} capped at the run's {num_classes} classes")
        return num_classes
    return k


@dataclass
class PredictionSummary:
    """What a prediction job wrote: rows, and per classifying client the labelled rows and the
    accuracy over them (percent; None without labelled rows)."""

    rows: int = 0
    per_client: dict[str, dict[str, Any]] = field(default_factory=dict)
    out: Path | None = None

    def add(self, client: str, labels: np.ndarray, pred: np.ndarray) -> None:
        self.rows += int(labels.shape[0])
        c = self.per_client.setdefault(client, {"n": 0, "n_labelled": 0, "correct": 0, "accuracy": None})
        known = labels >= 0
        c["n"] += int(labels.shape[0])
        c["n_labelled"] += int(known.sum())
        c["correct"] += int((pred[known] == labels[known]).sum())
        if c["n_labelled"]:
            c["accuracy"] = 100.0 * c["correct"] / c["n_labelled"]

    def accuracy_lines(self) -> list[str]:
        return [f"{c}: accuracy {v['accuracy']:.2f} % ({v['correct']}/{v['n_labelled']} labelled)"
                for c, v in self.per_client.items() if v["accuracy"] is not None]


def iter_tables(tr: Trained, store: Any, parts: Sequence[Part], k: int = 1, chunk_rows: int = 65536,
                progress: bool = False, summary: PredictionSummary | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Prediction tables (fedheads.prediction.prototypes.prediction_rows), one per chunk of each part and
    classifier; every check is done before this is called (the first table is written at once).
    `store`: the opened store (embedcache.store.reader.open_store), or its path."""
    from embedcache.progress import bar as tqdm
    from embedcache.store.reader import StoreInfo, iter_split_chunks, open_store

    info = store if isinstance(store, StoreInfo) else open_store(store, quiet=True)
    total = sum(len(p.by) * int(getattr(info.shard(tr.backbones[0], p.store_client, p.split), "n", 0)) for p in parts)
    chosen = {c: classifier(tr, c) for p in parts for c in p.by}
    with tqdm(total=total, desc="predict", unit="img", disable=not progress or total == 0) as bar:
        for p in parts:
            for feats, labels, ids in iter_split_chunks(info, tr.backbones, p.split, p.store_client, chunk_rows=chunk_rows):
                y = labels if p.labelled else np.full(labels.shape, -1, np.int64)
                for c in p.by:
                    pred = classify(tr, *chosen[c], feats, k)
                    who = GLOBAL if c is None else c
                    if summary is not None:
                        summary.add(who, y, pred.labels)
                    bar.update(len(ids))
                    yield inference.prediction_rows(who, ids, y, pred, tr.classes)


def store_parts(tr: Trained, store: str, info: Any, split: str, client: str) -> list[Part]:
    """Each wanted client's stored split, classified by that client's own state."""
    wanted = tr.clients if client == "all" else [client]
    for c in wanted:
        tr.client_index(c)
        if info.shard(tr.backbones[0], c, split) is None:
            raise UserError(f"{c}/{split}: not in store {store}")
    return [Part(c, split, (c,)) for c in wanted]


def prepare(p: Predict) -> tuple[Trained, Any, list[Part], int]:
    """Everything before the first prediction: the run, the features (the store, opened once
    where it was checked, or the path of the cache that `images` were extracted into), what to
    classify by whom, and the capped k."""
    from embedcache.store.reader import open_store

    run, store, images, manifest, split, client, cache = p.run, p.store, p.images, p.manifest, p.split, p.client, p.cache
    given = [n for n, v in (("store", store), ("images", images), ("manifest", manifest)) if v is not None]
    if len(given) != 1:
        raise UserError("--store / --manifest / --images: give exactly one" + (f" (got {', '.join(given)})" if given else ""))
    extraction = {"--cache": cache, "--batch-size": p.batch_size, "--weights-dir": p.weights_dir, "--plugin": p.plugins or None}
    ignored = [k for k, v in extraction.items() if v is not None] if store is not None else []
    if images is not None and split is not None:
        ignored.append("--split")
    if ignored:  # never silently ignored
        raise UserError(f"{', '.join(ignored)}: not used with --{given[0]} (extraction options are for new images; "
                        "--split is for --store / --manifest)")
    split = split or "test"
    if split not in ("train", "test"):
        raise UserError(f"--split {split}: must be train or test")
    tr = open_trained(run, p.seed, p.device)
    k = capped_k(p.top_k, len(tr.classes))
    if store is not None:
        info = open_store(str(store))
        check_store(tr, str(store), info)
        return tr, info, store_parts(tr, str(store), info, split, client or "all"), k
    from fedheads.prediction.inputs import ExtractOptions, extract_images, extract_manifest

    opts = ExtractOptions(str(Path(run) / "predict-cache" if cache is None else cache), p.device, p.batch_size,
                          p.num_workers, p.weights_dir, tuple(p.plugins), p.progress)
    if images is not None:
        if client is not None and client != "all":
            tr.client_index(client)
        by: tuple[str | None, ...] = (None,) if client is None else tuple(tr.clients) if client == "all" else (client,)
        if by == (None,):
            classifier(tr, None)  # refuse before extracting when there is no global model
        return tr, opts.cache, extract_images(tr, images, by, opts), k
    parts = extract_manifest(tr, manifest, split, client or "all", opts)
    info = open_store(opts.cache, quiet=True)
    check_store(tr, opts.cache, info)
    return tr, info, parts, k


def open_trained(run: str | Path, seed: int | None, device: str) -> Trained:
    """A `fedheads train` run's saved states, or a `fedheads finetune` run served as its exported
    backbone and final linear head (fedheads.finetuning.served)."""
    from fedheads.finetuning.served import is_finetune_run, trained_from_finetune
    from fedheads.run.saved import read_json

    results = read_json(Path(run) / "results.json")
    if is_finetune_run(results):
        return trained_from_finetune(Path(run), read_json(Path(run) / "config.json"), results, seed, device)
    return open_run(run, seed, device)


def run_predict(p: Predict) -> dict[str, np.ndarray] | PredictionSummary:
    """fedheads.api.predict's work: the table in memory, or streamed to `p.out` with a summary."""
    out = p.out
    if out is not None and Path(out).suffix.lower() not in (".csv", ".parquet"):
        raise UserError(f"{out}: unsupported extension (use .csv or .parquet)")  # before any extraction
    tr, feats, parts, k = prepare(p)
    summary = PredictionSummary(out=None if out is None else Path(out))
    tables = iter_tables(tr, feats, parts, k, p.chunk_rows, p.progress, summary)
    if out is not None:
        inference.write_predictions(tables, out)
        return summary
    got = list(tables)
    if not got:
        return {}
    return {c: np.concatenate([t[c] for t in got]) for c in got[0]}


def predict_array(tr: Trained, features: Any, client: str | None = None, top_k: int = 1,
                  chunk_rows: int = 65536) -> dict[str, np.ndarray]:
    """Classify features [N, D] (the run's backbones concatenated) held in memory: by `client`'s
    state, every client's ("all"), or the global model (None). Same columns as a prediction file
    (sample_id = row number, label -1)."""
    x = inference.as_f32(features, "features", tr.dim)
    k = capped_k(top_k, len(tr.classes))
    by: list[str | None] = [None] if client is None else list(tr.clients) if client == "all" else [client]
    ids, y = np.arange(x.shape[0]).astype(str), np.full(x.shape[0], -1, np.int64)
    tables = []
    for c in by:
        cs, rule = classifier(tr, c)
        for a in range(0, x.shape[0], chunk_rows):
            pred = classify(tr, cs, rule, x[a:a + chunk_rows], k)
            tables.append(inference.prediction_rows(GLOBAL if c is None else c, ids[a:a + chunk_rows],
                                                    y[a:a + chunk_rows], pred, tr.classes))
    return {col: np.concatenate([t[col] for t in tables]) for col in tables[0]} if tables else {}

