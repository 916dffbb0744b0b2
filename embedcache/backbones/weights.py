"""Where backbone weights live, how they are checked and (online only) fetched.

Resolution of the weights directory (first that applies wins):
``--weights-dir`` flag > ``$EMBEDCACHE_WEIGHTS`` > ``$EMBEDCACHE_ASSETS/weights`` >
``./../shared/weights`` (relative to the current directory, only if it exists) >
``~/.cache/embedcache/weights``. Files are then looked up in that directory and, when it is a
different one, in the download cache ``$EMBEDCACHE_CACHE/weights`` (default
``~/.cache/embedcache/weights``), where downloads and locally pre-trained weights go.

Downloads are attempted only when a published URL is known, ``$EMBEDCACHE_OFFLINE`` is not
``1`` (nor ``$HF_HUB_OFFLINE`` for the Hugging Face hub) and a TCP connection to the host (or
the proxy) opens within ``PROBE_SECONDS``: an offline machine gets one clear error in seconds
instead of a minute of client retries. Every downloaded file is verified against its sha256
before it is moved into place.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import socket
import threading
import urllib.parse
import urllib.request
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


PROBE_SECONDS = 2.5  # the longest an offline machine waits before a missing-weights error
_PROBED: dict[tuple[str, int], str | None] = {}  # per process: each host is probed once


def _truthy(var: str) -> bool:
    return os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def unreachable(url: str, timeout: float = PROBE_SECONDS) -> str | None:
    """None when a TCP connection to the host of ``url`` (or to the proxy that would carry it)
    opens within ``timeout`` seconds, else why not. Name resolution runs inside the bound too
    (in a thread): a resolver without network can block far longer than any socket timeout."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        pp = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = pp.hostname or host, pp.port or 80
    if not host:
        return f"{url}: no host"
    if (host, port) not in _PROBED:
        result = [f"{host}:{port}: no answer within {timeout:g} s"]

        def probe() -> None:
            try:
                socket.create_connection((host, port), timeout=timeout).close()
                result[0] = None
            except OSError as exc:
                result[0] = f"{host}:{port}: {exc.strerror or type(exc).__name__}"

        worker = threading.Thread(target=probe, daemon=True, name="embedcache-probe")
        worker.start()
        worker.join(timeout)
        _PROBED[(host, port)] = None if not worker.is_alive() and result[0] is None else result[0]
    return _PROBED[(host, port)]


def download_blocked(url: str, *, hf_hub: bool = False) -> str | None:
    """Why a download from ``url`` cannot happen now (offline settings, or the host does not
    answer within PROBE_SECONDS), or None when it may be tried."""
    if offline():
        return "$EMBEDCACHE_OFFLINE=1"
    if hf_hub and _truthy("HF_HUB_OFFLINE"):
        return "$HF_HUB_OFFLINE=1"
    why = unreachable(url)
    return None if why is None else f"offline? {why}"


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
        why = "no published URL" if url is None else download_blocked(url)
        if why is not None:
            raise UserError(f"{who}: weights not found; looked in {looked_in(rel, weights_dir)} ({why}; "
                            "pass --weights-dir or set $EMBEDCACHE_WEIGHTS)")
        path = download(url, rel, sha256, who=who)
    return path, verify_sha256(path, sha256)


def load_torch(path: Path, *, who: str) -> object:
    """torch.load with weights_only=True on CPU; unreadable files become UserError."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's text runs over several lines: its one fact kept
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        what = f"it pickles {found.group(1)}" if found else "it holds pickled objects, not only tensors"
        raise UserError(f"{path}: refused as a {who} checkpoint: {what}, which a weights-only load does not run "
                        "(save its state_dict, or convert it to .safetensors)") from None
    except Exception as exc:
        text = " ".join(str(exc).split())  # one line
        raise UserError(f"{path}: cannot be read as a {who} checkpoint ({type(exc).__name__}: {text[:200]})") from None
