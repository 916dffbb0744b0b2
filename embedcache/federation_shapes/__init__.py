"""Client sizes of real cross-device federations, to give a partition or a synthetic store the
skew of a real one (`embedcache partition --client-sizes NAME|CSV`).

Shipped shapes (training images per client; the counts only, as `train_images,clients` pairs):
- `inaturalist-users-120k`: iNaturalist-Users-120K, one client per iNaturalist user, 1,203 classes:
  9,275 clients, 120,293 training images, median 2, largest 2,511, smallest 1;
- `gldv2`: Google Landmarks v2, federated split, one client per photographer, 2,028 classes:
  1,262 clients, 151,373 training images, median 60, largest 2,858, smallest 25.
Both federations are defined by Hsu et al., "Federated Visual Classification with Real-World Data
Distribution" (ECCV 2020); the per-client counts are those published with "Accelerating
Heterogeneous Federated Learning with Closed-form Classifiers" (Fed3R, ICML 2024), repository
Erosinho13/Fed3R, dataset_statistics/*_original_client_sizes.csv.

A CSV of one's own is read as either those pairs (header `train_images,clients`), one row per
client with a `train_images` column, or one integer per line."""

from __future__ import annotations

import csv
from importlib import resources
from pathlib import Path

import numpy as np

from embedcache.errors import UserError

SHAPES = {
    "inaturalist-users-120k": "iNaturalist-Users-120K (9,275 clients, 120,293 training images, median 2)",
    "gldv2": "Google Landmarks v2, federated split (1,262 clients, 151,373 training images, median 60)",
}


def _parse(rows: list[list[str]], origin: str) -> np.ndarray:
    lines = [(i, row) for i, row in enumerate(rows, start=1) if "".join(row).strip()]
    if not lines:
        raise UserError(f"{origin}: no client sizes in it")
    first = lines[0][1]
    header = [h.strip() for h in first] if not first[0].strip().lstrip("-").isdigit() else None
    sizes: list[int] = []
    for i, row in lines[1:] if header is not None else lines:
        try:
            if header == ["train_images", "clients"]:
                size, count = int(row[0]), int(row[1])
            elif header is not None and "train_images" in header:
                size, count = int(row[header.index("train_images")]), 1
            elif header is None and len(row) == 1:
                size, count = int(row[0]), 1
            else:
                raise UserError(f"{origin}: header {','.join(header or row)!r}: want `train_images,clients`, a "
                                "`train_images` column, or one integer per line")
        except (ValueError, IndexError):
            raise UserError(f"{origin}, line {i}: {','.join(row)!r} is not a client size") from None
        if size < 1 or count < 1:
            raise UserError(f"{origin}, line {i}: {','.join(row)!r}: sizes and counts must be >= 1")
        sizes += [size] * count
    if not sizes:
        raise UserError(f"{origin}: no client sizes in it")
    return np.sort(np.asarray(sizes, dtype=np.int64))[::-1].copy()


def load_shape(shape: str | Path) -> np.ndarray:
    """The client sizes of `shape` (a name in SHAPES, or a CSV path), largest first."""
    name = str(shape)
    if name in SHAPES:
        text = resources.files(__name__).joinpath(f"{name}.csv").read_text()
        origin = name
    else:
        path = Path(name)
        if not path.is_file():
            raise UserError(f"--client-sizes {name}: neither a shipped shape ({', '.join(SHAPES)}) nor a CSV file")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--client-sizes {name}: cannot be read ({e})") from None
        origin = name
    return _parse(list(csv.reader(text.splitlines())), origin)


def draw_sizes(sizes: np.ndarray, clients: int | None = None) -> np.ndarray:
    """`clients` sizes at the quantiles (i + 0.5) / M of the shape's sizes, largest first: the
    shape's own sizes, exactly, when M is its number of clients (the default), and its
    distribution at any other M (the same median and tail, scaled in count)."""
    s = np.sort(np.asarray(sizes, dtype=np.int64))[::-1]
    m = len(s) if clients is None else int(clients)
    if m < 1:
        raise UserError(f"--clients {m}: must be >= 1")
    idx = np.floor((np.arange(m) + 0.5) * len(s) / m).astype(np.int64)
    return s[np.minimum(idx, len(s) - 1)]
