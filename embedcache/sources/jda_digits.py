"""`jda-digits:FILE.mat`: the MNIST-vs-USPS file of the JDA domain-adaptation benchmark.

Keys X_src (256, 2000) MNIST and X_tar (256, 1800) USPS, one 16x16 grey image per column in
[0, 1] (row-major: ``X.T.reshape(-1, 16, 16)`` is upright); Y_src / Y_tar labels 1..10 meaning
digit 0..9. Domains "mnist" and "usps"; locator "<domain>/<column>".

Fingerprint (either kind, contract 2): f"{sha256 of the .mat file, 32 hex}:{column}"; the file
is hashed once per process (again only if its size or mtime changes)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
from PIL import Image

from embedcache.errors import UserError

_KEYS = {"mnist": ("X_src", "Y_src"), "usps": ("X_tar", "Y_tar")}
_FILE_SHA: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, per process


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_SHA:
        _FILE_SHA[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _FILE_SHA[key]


class JDADigits:
    def __init__(self, spec: str, path: str) -> None:
        self.spec = spec
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"{spec}: file {self.path} not found")

    @functools.cached_property
    def _data(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        from scipy.io import loadmat

        try:
            mat = loadmat(str(self.path))
        except Exception as exc:
            raise UserError(f"{self.path}: not a readable .mat file ({exc})") from None
        out = {}
        for dom, (xk, yk) in _KEYS.items():
            if xk not in mat or yk not in mat:
                raise UserError(f"{self.path}: key {xk} or {yk} missing")
            x = np.asarray(mat[xk], np.float64).T.reshape(-1, 16, 16)
            y = np.asarray(mat[yk]).reshape(-1).astype(np.int64) - 1
            if len(x) != len(y) or y.min() < 0 or y.max() > 9:
                raise UserError(f"{self.path}: {yk} must hold {len(x)} labels in 1..10")
            out[dom] = ((np.clip(x, 0, 1) * 255 + 0.5).astype(np.uint8), y)
        return out

    def domains(self) -> list[str]:
        return list(_KEYS)

    def classes(self) -> list[str]:
        return [str(d) for d in range(10)]

    def index(self) -> list[tuple[str, str, int]]:
        return [(d, f"{d}/{i}", int(lab)) for d, (_, y) in self._data.items() for i, lab in enumerate(y)]

    def _column(self, locator: str) -> tuple[str, int]:
        dom, _, idx = locator.partition("/")
        if dom not in _KEYS or not idx.isdigit() or int(idx) >= len(self._data[dom][0]):
            raise UserError(f"{locator}: not a sample of {self.path}")
        return dom, int(idx)

    def fingerprint(self, locator: str, kind: str = "sha256") -> str:
        _, col = self._column(locator)
        if not self.path.is_file():
            raise UserError(f"{locator}: {self.path} is missing")
        return f"{_file_sha256(self.path)[:32]}:{col}"

    def load(self, locator: str) -> Image.Image:
        dom, col = self._column(locator)
        return Image.fromarray(self._data[dom][0][col], "L").convert("RGB")
