"""Small test doubles for the store/extract tests: a tiny image folder, a source that can be
made to fail when touched, a fixed-split manifest and tiny torch backbones (contract 3).
Module-level so that dask worker processes can unpickle them by reference. Also usable as
`--plugin store_doubles` from the CLI (registers the tiny backbones)."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from embedcache.errors import UserError
from embedcache.manifest import Client, Manifest, Sample
from embedcache.sources import open_source


def make_imagefolder(root: Path, domains=("a", "b"), classes=("cat", "dog", "emu"), per_class: int = 5,
                     size: int = 10) -> Path:
    """domain/class/img_k.png with deterministic random pixels."""
    rng = np.random.default_rng(0)
    for d in domains:
        for c in classes:
            (root / d / c).mkdir(parents=True, exist_ok=True)
            for k in range(per_class):
                px = rng.integers(0, 256, size=(size, size + k % 3, 3), dtype=np.uint8)
                Image.fromarray(px).save(root / d / c / f"img_{k}.png")
    return root


@dataclass
class FolderSource:
    """The real `imagefolder:` source, except that `fail=True` makes every load an error
    (to prove a cache hit touches no image)."""

    root: str
    fail: bool = False

    def load(self, locator: str) -> Image.Image:
        if self.fail:
            raise AssertionError(f"image source touched: {locator}")
        return open_source(f"imagefolder:{self.root}").load(locator)

    def fingerprint(self, locator: str, kind: str = "sha256") -> str:
        # a stat (or a file hash), never a decode: allowed even when fail=True
        return open_source(f"imagefolder:{self.root}").fingerprint(locator, kind)


def make_manifest(root: Path, test_every: int = 3, domains=None, classes=None, per_class: int | None = None) -> Manifest:
    """One client per domain; every `test_every`-th image goes to test. `domains`, `classes`,
    `per_class` pick a subset (e.g. a handful of real images)."""
    doms = sorted(domains or (p.name for p in root.iterdir() if p.is_dir()))
    classes = tuple(classes or sorted(p.name for p in (root / doms[0]).iterdir() if p.is_dir()))
    clients = []
    for d in doms:
        train, test = [], []
        for ci, c in enumerate(classes):
            for k, f in enumerate(sorted((root / d / c).iterdir())[:per_class]):
                s = Sample(f"{d}/{c}/{f.name}", f"{d}/{c}/{f.name}", ci)
                (test if k % test_every == 0 else train).append(s)
        clients.append(Client(f"c-{d}", d, tuple(train), tuple(test)))
    return Manifest(f"imagefolder:{root}", classes, tuple(clients))


class TinyBackbone:
    """Contract-3 backbone: 8x8 input, a fixed-seed conv, ReLU and global average pool -> D=4.
    `delay` sleeps per batch (kill tests); `scale` lets a test push float16 past 65504."""

    def __init__(self, name: str = "tiny", delay: float = 0.0, scale: float = 1.0, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.name = name
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=g))
            self.conv.bias.copy_(torch.randn(4, generator=g))
        self.conv.eval()
        self.delay = delay
        self.scale = scale
        self.feature_dim = 4
        h = hashlib.sha256(self.conv.weight.detach().numpy().tobytes() + self.conv.bias.detach().numpy().tobytes())
        self.weights_sha256 = h.hexdigest()
        self.preprocess = {"input_size": [3, 8, 8], "resize": [8, 8], "mean": None, "std": None}

    def transform(self, img: Image.Image, *, train: bool = False) -> torch.Tensor:
        x = torch.from_numpy(np.asarray(img.convert("RGB").resize((8, 8)), dtype=np.float32) / 255.0)
        x = x.permute(2, 0, 1).contiguous()
        if train:  # random flip + random brightness from the global torch RNG
            if torch.rand(()) < 0.5:
                x = x.flip(-1)
            x = x * (0.5 + torch.rand(()))
        return x

    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        with torch.inference_mode():
            return torch.relu(self.conv(batch)).mean(dim=(2, 3)) * self.scale

    def to(self, device: str) -> TinyBackbone:
        return self


def tiny_factory(name: str, weights_dir: str | None, device: str) -> TinyBackbone:
    """backbone_factory for tests: "tiny", "tiny2" (other weights), "tiny-slow", "tiny-huge"."""
    if name == "tiny":
        return TinyBackbone("tiny")
    if name == "tiny2":
        return TinyBackbone("tiny2", seed=1)
    if name == "tiny-slow":
        return TinyBackbone("tiny-slow", delay=float(os.environ.get("TINY_DELAY", "0.05")))
    if name == "tiny-huge":
        return TinyBackbone("tiny-huge", scale=1e6)
    raise UserError(f"{name}: unknown backbone")


def _register() -> None:
    try:
        from embedcache.backbones import register_backbone
    except ImportError:
        return
    for n in ("tiny", "tiny2", "tiny-slow", "tiny-huge"):
        register_backbone(n, lambda wd, dev, n=n: tiny_factory(n, None, dev), description=f"test double {n}")


def assert_one_line(res, code: int, *needles: str) -> None:
    """A CLI result (click.testing) that exited `code` with one line of output containing every needle."""
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    for n in needles:
        assert n in lines[0], res.output


_register()


SKEWED = [3, 40, 5, 6, 41, 90, 4, 7, 300, 8]  # train rows per client: a few large, many small


def skewed_store(tmp_path: Path, seed: int = 2) -> Path:
    """A feature store (backbone "bb", 6-d, 3 classes around separated centres) of ten clients of
    SKEWED training rows and 6 test rows each, imported into tmp_path/s.zarr (layout tests)."""
    from embedcache.store.importer import import_features

    tmp_path.mkdir(parents=True, exist_ok=True)
    store = tmp_path / "s.zarr"
    rs = np.random.default_rng(seed)
    centers = rs.normal(size=(3, 6)) * 3
    for k, n in enumerate(SKEWED):
        for split, m in (("train", n), ("test", 6)):
            y = rs.integers(0, 3, m)
            f = tmp_path / f"c{k}-{split}.npz"
            np.savez(f, features=(centers[y] + rs.normal(size=(m, 6))).astype("f4"), labels=y)
            import_features(store, f, backbone="bb", client=f"c{k}", split=split, domain="d", classes=["a", "b", "c"])
    return store
