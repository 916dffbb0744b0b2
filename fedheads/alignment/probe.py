"""FedDRA's few-shot probe (Table 2 "cls." columns; [R] MGCA-style linear probe, encoder frozen) on
an out-of-distribution manifest, with three feature sets:

  z         the aligned image representation f_Psi(f_psi(x)) of the trained global model,
            computed in this process (the alignment module is not a backbone of the registry);
  pooled    the trained image encoder's pooled output, cached like any backbone through the run's
            exported `ckpt:` file (`embedcache extract --backbones ckpt:RUN/encoders/image-seedS.pt`);
  backbone  the pre-trained image encoder's pooled output (the reference a probe must beat: the
            FedDRA notes measured raw ResNet-20 features above both federated runs).

Cached features go to RUN_DIR/probe.zarr (verified shards; the pre-trained backbone is a cache
hit after the first seed). Each feature set gets fedheads' `lp` on k shots per class
(feddra_eval.few_shot_probe). The manifest's texts are not needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from embedcache.errors import UserError
from fedheads.alignment.evaluation import few_shot_probe
from fedheads.finetuning.data import ImageLoader, _Images

FEATURES = ("z", "pooled", "backbone")


@dataclass(frozen=True)
class ProbeOptions:
    """The probe protocol (FedDRA notes: 1- and 5-shot over 5 draws on webcam + dslr)."""

    manifest: str  # out-of-distribution manifest (e.g. webcam + dslr), train rows = the labelled pool
    shots: tuple[int, ...] = (1, 5)  # labelled images per class
    draws: int = 5  # seeded draws per k
    rounds: int = 50  # LP rounds (one local epoch each) on the k-shot set
    lp_settings: tuple[tuple[str, Any], ...] = (("init", "fedncm"),)  # fedheads `lp` config fields
    features: tuple[str, ...] = FEATURES

    def __post_init__(self) -> None:
        bad = [f for f in self.features if f not in FEATURES]
        if bad or not self.features:
            raise UserError(f"--probe-features {','.join(self.features)}: use some of {', '.join(FEATURES)}")
        if not self.shots or min(self.shots) < 1 or self.draws < 1 or self.rounds < 1:
            raise UserError("--probe-shots, --probe-draws and probe rounds must be >= 1")


def _pool(m: Any, split: str) -> tuple[list[str], np.ndarray]:
    samples = [s for c in m.clients for s in getattr(c, split)]
    return [s.locator for s in samples], np.array([s.label for s in samples], dtype=np.int64)


@torch.no_grad()
def _z_features(glob: Any, m: Any, transform: Any, device: torch.device) -> dict[str, np.ndarray]:
    from embedcache.sources import open_source

    glob.eval()
    out = {}
    for split in ("train", "test"):
        locs, _ = _pool(m, split)
        loader = ImageLoader(_Images(open_source(m.source), locs, transform), 0, pin_memory=False)
        reqs = [[(i, -1) for i in range(a, min(a + 64, len(locs)))] for a in range(0, len(locs), 64)]
        zs = [F.normalize(glob.psi(glob.image_tokens(x), None).float(), dim=-1).cpu() for x in loader.read(reqs, device)]
        out[split] = torch.cat(zs).numpy() if zs else np.zeros((0, glob.psi.out.out_features), np.float32)
    return out


def _store_features(m: Any, store: Path, name: str, weights_dir: str | None) -> dict[str, np.ndarray]:
    from embedcache.extraction import ExtractConfig, extract
    from embedcache.store.reader import load_split

    extract(m, ExtractConfig(backbones=(name,), store=str(store), weights_dir=weights_dir, progress=False))
    out = {}
    for split in ("train", "test"):
        parts = load_split(str(store), [name], split, clients=[c.name for c in m.clients])
        out[split] = np.concatenate([parts[c.name].features for c in m.clients])
    return out


def run_probe(po: ProbeOptions, glob: Any, su: Any, out: Path, seed: int, exported: dict) -> dict[str, Any]:
    """{feature: {k: {mean, std, values}} or {"skipped": reason}} for one seed's trained model."""
    from embedcache.manifest import load_manifest

    m = load_manifest(po.manifest)
    _, y_tr = _pool(m, "train")
    _, y_te = _pool(m, "test")
    res: dict[str, Any] = {"manifest_hash": m.content_hash, "n_train": int(len(y_tr)), "n_test": int(len(y_te)),
                           "shots": list(po.shots), "draws": po.draws}
    for feat in po.features:
        if feat == "z":
            x = _z_features(glob, m, su.image_bb.transform, su.device)
        elif feat == "backbone":
            x = _store_features(m, out / "probe.zarr", su.image_bb.name, su.weights_dir)
        else:  # the trained encoder's pooled output through its exported ckpt: file
            x = _store_features(m, out / "probe.zarr", f"ckpt:{exported['image']['path']}", su.weights_dir)
        res[feat] = few_shot_probe(x["train"], y_tr, x["test"], y_te, num_classes=len(m.classes), shots=po.shots,
                                   draws=po.draws, seed=seed, rounds=po.rounds, lp_settings=dict(po.lp_settings))
    return res
