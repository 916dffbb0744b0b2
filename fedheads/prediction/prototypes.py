"""Prototype inference with faiss: nearest class prototype per client, streamed in row chunks.

Each client classifies with its own bank of class prototypes (FedPCL inference: nearest
*local* prototype; FedProto likewise; FedNCM: nearest class mean). A bank is a dense
``[C, D]`` array plus a presence mask ``[C]`` (never an ordered dict: see
docs on PFLlib's misaligned columns); classes a client lacks are left out of its index, so
they can never be predicted (the authors' code gives them "a large distance" instead).

Rules (chosen by the algorithm):
  * ``"cosine"``: IndexFlatIP over unit vectors (prototypes and queries L2-normalised);
    score = cosine similarity, higher is nearer.
  * ``"ip"``: IndexFlatIP on the vectors as they are; score = inner product, higher is
    nearer (FedPCL's rule: its z is unit length, its prototypes are means of unit vectors
    and are not re-normalised, so this is not cosine).
  * ``"sqeuclidean"``: IndexFlatL2; score = squared Euclidean distance, lower is nearer.
Ties are broken towards the smaller class id, whatever order faiss returns them in.

Flat (exact) indexes only: prototype banks have tens to hundreds of rows, far below the
millions where IVF/PQ pay off. GPU indexes are used only when this faiss build has GPU
support *and* a GPU is visible; results are the same either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from embedcache.atomic import atomic_path
from embedcache.errors import UserError

RULES = ("cosine", "ip", "sqeuclidean")
SIMILARITY_RULES = ("cosine", "ip")  # higher score is nearer
_GPU_MAX_K = 2048  # faiss GPU k-selection limit
_GPU_RES: Any = None  # one StandardGpuResources per process (it owns scratch memory)


def as_f32(x: Any, name: str, dim: int | None = None) -> np.ndarray:
    """2-D float32 C-contiguous copy-if-needed of ``x``; checks width and finiteness."""
    a = np.ascontiguousarray(np.asarray(x), dtype=np.float32)
    if a.ndim != 2:
        raise UserError(f"{name}: expected a 2-D array, got shape {a.shape}")
    if dim is not None and a.shape[1] != dim:
        raise UserError(f"{name}: dimension {a.shape[1]} != prototype dimension {dim}")
    if not np.all(np.isfinite(a)):
        raise UserError(f"{name}: contains NaN or inf")
    return a


def gpu_available() -> bool:
    """True when faiss was built with GPU support and sees at least one GPU."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class PrototypeIndex:
    """A faiss Flat index over the present prototypes of one client."""

    def __init__(self, prototypes: Any, present: Any, rule: str, use_gpu: bool | None = None):
        if rule not in RULES:
            raise UserError(f"rule={rule!r}: must be one of {', '.join(RULES)}")
        protos = as_f32(prototypes, "prototypes")
        mask = np.asarray(present, dtype=bool).reshape(-1)
        if mask.shape[0] != protos.shape[0]:
            raise UserError(f"present: {mask.shape[0]} entries for {protos.shape[0]} prototypes")
        self.rule = rule
        self.dim = int(protos.shape[1])
        self.num_classes = int(protos.shape[0])
        self.class_ids = np.flatnonzero(mask).astype(np.int64)  # index row -> class id
        if self.class_ids.size == 0:
            raise UserError("present: no class is present, nothing to predict")
        bank = np.ascontiguousarray(protos[self.class_ids])
        if rule == "cosine":
            faiss.normalize_L2(bank)
        if rule in SIMILARITY_RULES:
            index = faiss.IndexFlatIP(self.dim)
        else:
            index = faiss.IndexFlatL2(self.dim)
        # faiss GPU search is limited to k <= 2048 and tie resolution may ask for every row
        fits_gpu = self.class_ids.size <= _GPU_MAX_K
        if use_gpu is None:
            use_gpu = gpu_available() and fits_gpu
        if use_gpu:
            if not gpu_available():
                raise UserError("use_gpu=True: this faiss build has no GPU support or sees no GPU")
            if not fits_gpu:
                raise UserError(f"use_gpu=True: {self.class_ids.size} prototypes exceed faiss-gpu's "
                                f"k limit {_GPU_MAX_K}")
            global _GPU_RES
            if _GPU_RES is None:
                _GPU_RES = faiss.StandardGpuResources()
            index = faiss.index_cpu_to_gpu(_GPU_RES, 0, index)
        index.add(bank)
        self.index = index
        self.on_gpu = bool(use_gpu)

    @property
    def size(self) -> int:
        return int(self.class_ids.size)

    def search(self, queries: Any, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(scores [N,k] float32, class ids [N,k] int64), nearest first; when ``k`` exceeds
        the number of present classes the extra columns hold NaN and -1."""
        if k < 1:
            raise UserError(f"k={k}: must be >= 1")
        q = as_f32(queries, "features", self.dim)
        if self.rule == "cosine":
            q = q.copy()
            faiss.normalize_L2(q)
        n, kk = q.shape[0], min(k, self.size)
        # one extra candidate reveals whether a tie may be cut off at position kk
        k2 = min(self.size, kk + 1)
        d, i = self.index.search(q, k2)
        if k2 > kk:
            cut = d[:, kk - 1] == d[:, k2 - 1]
            if cut.any():  # rare: fetch every prototype for the tied rows only
                d_all, i_all = self.index.search(q[cut], self.size)
                rows = _order(d_all, i_all, self.rule)
                d_sel, i_sel = rows[0][:, :k2], rows[1][:, :k2]
                d, i = d.copy(), i.copy()
                d[cut], i[cut] = d_sel, i_sel
        d, i = _order(d, i, self.rule)
        scores = np.full((n, k), np.nan, np.float32)
        labels = np.full((n, k), -1, np.int64)
        scores[:, :kk] = d[:, :kk]
        labels[:, :kk] = self.class_ids[i[:, :kk]]
        return scores, labels


def _order(d: np.ndarray, i: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """Sort each row nearest-first, ties by smaller index row (= smaller class id, since
    index rows follow class order)."""
    key = -d if rule in SIMILARITY_RULES else d
    order = np.lexsort((i, key), axis=1)
    return np.take_along_axis(d, order, 1), np.take_along_axis(i, order, 1)


@dataclass(frozen=True)
class Predictions:
    """Predictions of one client's samples."""

    labels: np.ndarray  # [N] int64 predicted class (top-1)
    scores: np.ndarray  # [N] float32 score of the top-1 class (cosine sim. or squared dist.)
    topk_labels: np.ndarray  # [N, k] int64, -1 where fewer than k classes are present
    topk_scores: np.ndarray  # [N, k] float32, NaN where fewer than k classes are present


def iter_row_chunks(array: Any, chunk_rows: int = 65_536) -> Iterator[np.ndarray]:
    """Row slices of any sliceable array (numpy, memmap, zarr.Array): only one chunk is
    resident at a time."""
    if chunk_rows < 1:
        raise UserError(f"chunk_rows={chunk_rows}: must be >= 1")
    n = int(array.shape[0])
    for start in range(0, n, chunk_rows):
        yield np.asarray(array[start:start + chunk_rows])


def predict_features(prototypes: Any, present: Any, rule: str,
                     features: Any | Iterable[Any], k: int = 1, chunk_rows: int = 65_536,
                     use_gpu: bool | None = None) -> Predictions:
    """Nearest-prototype prediction of ``features`` in bounded memory.

    ``features`` is an array-like with ``.shape`` (numpy, memmap, zarr array: read in
    ``chunk_rows`` slices) or an iterable of ``[n_i, D]`` chunks. Memory is one chunk plus
    the O(N*k) outputs."""
    index = PrototypeIndex(prototypes, present, rule, use_gpu=use_gpu)
    chunks = iter_row_chunks(features, chunk_rows) if hasattr(features, "shape") else features
    s_parts, l_parts = [], []
    for chunk in chunks:
        s, lab = index.search(chunk, k)
        s_parts.append(s)
        l_parts.append(lab)
    if not s_parts:
        s_all, l_all = np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    else:
        s_all, l_all = np.concatenate(s_parts), np.concatenate(l_parts)
    return Predictions(labels=l_all[:, 0].copy(), scores=s_all[:, 0].copy(),
                       topk_labels=l_all, topk_scores=s_all)


def prediction_rows(client: str, sample_ids: Any, labels: Any, pred: Predictions,
                    class_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Columnar table for :func:`write_predictions`: client, sample_id, label, prediction,
    score, then top{j}_label / top{j}_score for j = 1..k when k > 1. With `class_names`, each
    class column is followed by its name (label_name, prediction_name, top{j}_name; "" for -1)."""
    n = pred.labels.shape[0]
    ids, y = np.asarray(sample_ids).astype(str), np.asarray(labels, dtype=np.int64)
    if ids.shape[0] != n or y.shape[0] != n:
        raise UserError(f"{client}: {ids.shape[0]} ids / {y.shape[0]} labels for {n} predictions")
    # index -1 (no label, no class) reads the trailing "" of the lookup table
    names = None if class_names is None else np.array([*map(str, class_names), ""], dtype=object)
    cols: dict[str, np.ndarray] = {"client": np.full(n, client, dtype=object), "sample_id": ids}

    def classes(col: str, name_col: str, idx: np.ndarray) -> None:
        cols[col] = idx
        if names is not None:
            cols[name_col] = names[idx]

    classes("label", "label_name", y)
    classes("prediction", "prediction_name", pred.labels)
    cols["score"] = pred.scores
    if pred.topk_labels.shape[1] > 1:
        for j in range(1, pred.topk_labels.shape[1] + 1):
            classes(f"top{j}_label", f"top{j}_name", pred.topk_labels[:, j - 1])
            cols[f"top{j}_score"] = pred.topk_scores[:, j - 1]
    return cols


def write_predictions(rows: Mapping[str, Any] | Iterable[Mapping[str, Any]], path: str | Path,
                      ) -> Path:
    """Write one table or a stream of tables (same columns) to ``.csv`` or ``.parquet``.

    Written to a temporary file in the target directory and renamed at the end, so a
    partial file never carries the final name. Parquet needs pyarrow (``pip install
    fedfrozen[parquet]``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".parquet"):
        raise UserError(f"{path}: unsupported extension (use .csv or .parquet)")
    tables = [rows] if isinstance(rows, Mapping) else rows
    if suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise UserError(f"{path}: writing .parquet needs pyarrow "
                            "(pip install 'fedfrozen[parquet]')") from exc
    with atomic_path(path) as tmp:
        columns: list[str] | None = None
        if suffix == ".csv":
            import csv

            with open(tmp, "w", newline="", encoding="utf-8") as fh:
                w = csv.writer(fh)
                for t in tables:
                    columns = _check_columns(t, columns, path)
                    if fh.tell() == 0:
                        w.writerow(columns)
                    w.writerows(zip(*(_csv_col(np.asarray(t[c])) for c in columns)))
        else:
            writer = None
            try:
                for t in tables:
                    columns = _check_columns(t, columns, path)
                    tab = pa.table({c: _arrow_col(np.asarray(t[c])) for c in columns})
                    if writer is None:
                        writer = pq.ParquetWriter(str(tmp), tab.schema)
                    writer.write_table(tab)
            finally:
                if writer is not None:
                    writer.close()
        if columns is None:
            raise UserError(f"{path}: no prediction rows to write")
    return path


def _check_columns(t: Mapping[str, Any], columns: list[str] | None, path: Path) -> list[str]:
    cols = list(t.keys())
    if columns is not None and cols != columns:
        raise UserError(f"{path}: tables have different columns ({cols} vs {columns})")
    lengths = {len(np.asarray(t[c])) for c in cols}
    if len(lengths) > 1:
        raise UserError(f"{path}: columns of one table have different lengths {sorted(lengths)}")
    return cols


def _csv_col(a: np.ndarray) -> list[Any]:
    """Floats as the shortest text that round-trips their own precision; NaN as empty."""
    if a.dtype.kind != "f":
        return a.tolist()
    return ["" if np.isnan(v) else np.format_float_positional(v, unique=True, trim="-")
            for v in a]


def _arrow_col(a: np.ndarray) -> Any:
    return a.astype(str) if a.dtype == object else a
