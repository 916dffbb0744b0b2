"""Shared test fixtures. `../shared` (or $EMBEDCACHE_ASSETS) is optional: tests that
need it are marked `shared` and skip with a clear reason when it is absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path | None:
    env = os.environ.get("EMBEDCACHE_ASSETS")
    cand = Path(env) if env else REPO.parent / "shared"
    return cand if cand.is_dir() else None


@pytest.fixture(scope="session", autouse=True)
def _private_settings_cache(tmp_path_factory):
    """`fedheads algorithms NAME` keeps its text under $FEDHEADS_CACHE: the suite's in a temporary
    directory of its own (children inherit it), never the user's home."""
    old = os.environ.get("FEDHEADS_CACHE")
    os.environ["FEDHEADS_CACHE"] = str(tmp_path_factory.mktemp("fedheads-cache"))
    yield
    if old is None:
        os.environ.pop("FEDHEADS_CACHE", None)
    else:
        os.environ["FEDHEADS_CACHE"] = old


@pytest.fixture(scope="session")
def shared() -> Path:
    d = shared_dir()
    if d is None:
        pytest.skip("../shared (or $EMBEDCACHE_ASSETS) is not present")
    return d


@pytest.fixture(scope="session")
def cifar_weights(shared: Path) -> Path:
    d = shared / "weights" / "cifar10_resnet"
    if not d.is_dir():
        pytest.skip(f"{d} not present")
    return d


@pytest.fixture
def offline_cache(monkeypatch, tmp_path):
    """No downloads, a private download cache, and no weights-dir overrides from the caller's
    environment (the default resolution is then used)."""
    monkeypatch.setenv("EMBEDCACHE_OFFLINE", "1")
    monkeypatch.setenv("EMBEDCACHE_CACHE", str(tmp_path / "cache"))
    for var in ("EMBEDCACHE_WEIGHTS", "EMBEDCACHE_ASSETS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def float32_math():
    """Full float32 arithmetic on CUDA for comparisons with the CPU: cuDNN convolutions default to
    TF32 (a 10-bit mantissa) on Ampere and later, which would compare TF32 rounding, not the code.
    (A store extracted on CUDA holds bf16-precision features: such tests extract on the CPU.)
    Attention runs on PyTorch's math backend, as on the CPU (the fused kernels CUDA picks otherwise
    may compute in reduced precision). FedDRA's float32 drift on an H200 was dropout, not these:
    see no_text_dropout in tests/test_gpu_live.py."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def drawn(monkeypatch):
    """Figures handed to save(), drawn, instead of written (plotting and pipelines.figures)."""
    from fedheads.report import plotting
    from pipelines import figures

    figs = []

    def keep(fig, path):
        fig.canvas.draw()
        figs.append(fig)
        return path
    monkeypatch.setattr(plotting, "save", keep)
    monkeypatch.setattr(figures, "_save", keep)
    yield figs
    for f in figs:
        plotting.pyplot().close(f)
