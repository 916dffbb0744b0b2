"""Where backbone weights live, how they are checked and (online only) fetched.

Resolution of the weights directory (first that applies wins):
``--weights-dir`` flag > ``$EMBEDCACHE_WEIGHTS`` > ``$EMBEDCACHE_ASSETS/weights`` >
``./../shared/weights`` (relative to the current directory, only if it exists) >
``~/.cache/embedcache/weights``. Files are then looked up in that directory and, when it is a
different one, in the download cache ``$EMBEDCACHE_CACHE/weights`` (default
``~/.cache/embedcache/weights``), where downloads and locally pre-trained weights go.

Downloads are attempted only when a published URL is known and ``$EMBEDCACHE_OFFLINE`` is not
``1``; every downloaded file is verified against its sha256 before it is moved into place.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from embedcache.errors import UserError

_CHUNK = 1 << 20


def cache_root() -> Path:
    """``$EMBEDCACHE_CACHE`` or ``~/.cache/embedcache`` (downloads, local pre-training)."""
    env = os.environ.get("EMBEDCACHE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "embedcache"


def cache_weights_dir() -> Path:
    return cache_root() / "weights"


def resolve_weights_dir(weights_dir: str | os.PathLike | None = None) -> Path:
    """The weights directory by the priority in the module docstring (may not exist)."""
    if weights_dir is not None:
        return Path(weights_dir).expanduser()
    env = os.environ.get("EMBEDCACHE_WEIGHTS")
    if env:
        return Path(env).expanduser()
    assets = os.environ.get("EMBEDCACHE_ASSETS")
    if assets:
        return Path(assets).expanduser() / "weights"
    shared = Path.cwd().parent / "shared" / "weights"
    if shared.is_dir():
        return shared
    return cache_weights_dir()


def search_dirs(weights_dir: str | os.PathLike | None = None) -> list[Path]:
    """Directories searched for a weights file, in order, without duplicates."""
    out: list[Path] = []
    for d in (resolve_weights_dir(weights_dir), cache_weights_dir()):
        if d not in out:
            out.append(d)
    return out


def find_file(rel: str, weights_dir: str | os.PathLike | None = None) -> Path | None:
    """First existing ``<dir>/<rel>`` over :func:`search_dirs`, else None."""
    for d in search_dirs(weights_dir):
        p = d / rel
        if p.is_file():
            return p
    return None


def looked_in(rel: str, weights_dir: str | os.PathLike | None = None) -> str:
    return ", ".join(str(d / rel) for d in search_dirs(weights_dir))


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str | None) -> str:
    """sha256 of ``path``; UserError naming the file when it differs from ``expected``."""
    got = sha256_file(path)
    if expected is not None and got != expected:
        raise UserError(f"{path}: sha256 {got} does not match the published {expected} (corrupt or wrong file)")
    return got


def offline() -> bool:
    return os.environ.get("EMBEDCACHE_OFFLINE", "") == "1"


def download(url: str, rel: str, sha256: str | None, *, who: str) -> Path:
    """Fetch ``url`` into the cache as ``<cache>/weights/<rel>``, verify, then os.replace.

    A partial or corrupt download never lands under the final name.
    """
    import torch.hub

    dest = cache_weights_dir() / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".part{os.getpid()}")
    try:
        torch.hub.download_url_to_file(url, str(tmp), progress=True)
        verify_sha256(tmp, sha256)
        os.replace(tmp, dest)
    except UserError:
        raise
    except Exception as exc:  # network errors come in many types (URLError, OSError, HTTP...)
        raise UserError(f"{who}: could not download {url} ({type(exc).__name__}: {exc}); "
                        f"offline? put the file at {dest} or pass --weights-dir") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return dest


def locate(rel: str, *, who: str, weights_dir: str | os.PathLike | None = None,
           sha256: str | None = None, url: str | None = None) -> tuple[Path, str]:
    """Find (or, online with a known URL, download) a weights file; return (path, sha256)."""
    path = find_file(rel, weights_dir)
    if path is None:
        if url is None or offline():
            why = "no published URL" if url is None else "$EMBEDCACHE_OFFLINE=1"
            raise UserError(f"{who}: weights not found; looked in {looked_in(rel, weights_dir)} ({why}; "
                            "pass --weights-dir or set $EMBEDCACHE_WEIGHTS)")
        path = download(url, rel, sha256, who=who)
    return path, verify_sha256(path, sha256)


def load_torch(path: Path, *, who: str) -> object:
    """torch.load with weights_only=True on CPU; unreadable files become UserError."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(f"{path}: cannot be read as a {who} checkpoint ({type(exc).__name__}: {exc})") from None
