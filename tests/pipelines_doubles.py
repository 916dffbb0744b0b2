"""Test doubles for the pipelines tests (imported, not collected; also `--plugin pipelines_doubles`):
tiny backbones with the real stand-ins' roles, fake copies of the papers' data-set layouts, and a
small registered experiment ("test-sweep") with a method that always fails."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
from PIL import Image

from embedcache.backbones.registry import register_backbone
from pipelines import registry
from pipelines.spec import BackboneSet, Claim, DataRecipe, Experiment, Layout, Method, Point, Published, ScaleSpec

TINY = ("pl-tiny-a", "pl-tiny-b", "pl-tiny-c")
# every offline stand-in of the registry -> a tiny double (`--backbone NAME=OTHER`)
STANDINS = {"resnet20-cifar10": "pl-tiny-a", "mobilenet-v2-tflite": "pl-tiny-b", "digitnet-builtin": "pl-tiny-c",
            "resnet32-cifar10": "pl-tiny-b", "resnet56-cifar10": "pl-tiny-c"}


def _register() -> None:
    from store_doubles import TinyBackbone

    for i, name in enumerate(TINY):
        register_backbone(name, lambda wd, dev, n=name, s=i: TinyBackbone(n, seed=s + 10),
                          description=f"pipelines test double {i}")
    import live_doubles

    def staged(wd=None, device="cpu"):
        bb = live_doubles.build(wd, device)
        bb = copy.copy(bb)
        bb.name = "pl-staged"
        return bb

    register_backbone("pl-staged", staged, description="trainable test double", cut_points=("stem", "block"))


def backbone_args() -> list[str]:
    return [a for k, v in STANDINS.items() for a in ("--backbone", f"{k}={v}")]


def _png(path: Path, rng: np.random.Generator, tint: int, size: int = 12) -> None:
    px = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    px[..., tint % 3] = np.clip(px[..., tint % 3].astype(int) + 60, 0, 255).astype(np.uint8)  # a class signal
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(px).save(path)


def make_folder(root: Path, domains: tuple[str, ...], classes: tuple[str, ...], per_class: int = 6,
                ext: str = "png") -> Path:
    """root/<domain>/<class>/<k>.<ext>, deterministic pixels with a weak class signal."""
    rng = np.random.default_rng(len(domains) * 100 + len(classes))
    for d in domains:
        for ci, c in enumerate(classes):
            for k in range(per_class):
                _png(root / d / c / f"{k:03d}.{ext}", rng, ci)
    return root


def make_svhn_mat(path: Path, n: int = 60) -> Path:
    """A fake `svhn_train_32x32.mat` in the layout SVHN ships: X [32, 32, 3, N] uint8, y [N, 1] in 1..10
    (10 means digit 0)."""
    from scipy.io import savemat

    rng = np.random.default_rng(5)
    savemat(str(path), {"X": rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8),
                        "y": (np.arange(n) % 10 + 1).reshape(-1, 1).astype(np.uint8)})
    return path


OFFICE = make_folder  # the layout as distributed: office_caltech10/{amazon,caltech10,dslr,webcam}/<class>


def sweep_experiment(name: str = "test-sweep", seeds: tuple[int, ...] = (0, 1), rounds: int = 3) -> Experiment:
    """Office-10 feature & label shift on the tiny backbones: FedPCL, FedAvg and a method whose
    configuration is invalid (every cell of it fails)."""
    data = DataRecipe("office10", "feature-label-shift", clients=4, alpha=1.0, train_per_class=3)
    bs = BackboneSet("two tiny backbones", paper=("missing:nothing",), standin=TINY[:2], note="test doubles")
    sc = ScaleSpec(rounds=rounds, seeds=seeds, test_per_class=4, eval_every=1)
    return Experiment(
        name=name, title="pipelines test", paper="FedPCL", source="Table T", summary="a test",
        methods=(Method("Ours", "fedpcl"), Method("FedAvg", "fedavg"),
                 Method("Broken", "fedavg", settings=(("batch_size", 0),))),
        points=(Point((("dataset", "Office-10"),), data, bs),),
        published=(Published("Ours", "acc", 40.0, 1.0, (("dataset", "Office-10"),)),
                   Published("FedAvg", "acc", 30.0, 1.0, (("dataset", "Office-10"),))),
        claims=(Claim("Ours above FedAvg", "Ours", over=("FedAvg",)),),
        layout=Layout(rows=("method",), columns=("dataset",)),
        scales=(("smoke", sc), ("ci", sc), ("paper", sc)))


_register()
registry.register(sweep_experiment())
registry.register(sweep_experiment("test-sweep-many", seeds=tuple(range(8)), rounds=4))


def slow_cell(cell: dict, cells_dir: str) -> dict:
    """`run_cell`, then a pause: a sweep stays mid-way long enough to be interrupted."""
    import time

    from pipelines.cells import run_cell

    rec = run_cell(cell, cells_dir)
    time.sleep(3.0)
    return rec
