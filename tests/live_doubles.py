"""A tiny trainable backbone (contract 3 with `trainable()` -> StagedNet) and its cut variant,
registered as "tiny-staged" (its maps: "tiny-staged@stem", built by the registry) so the fine-tuning tests run in seconds
without weights files. Imported (not collected) by tests/test_live_*.py."""

from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn

from embedcache.backbones.base import TorchBackbone, state_dict_sha256
from embedcache.backbones.registry import register_backbone

PREPROCESS = {"pipeline": "torchvision", "input_size": [3, 8, 8], "resize": [8, 8], "crop": None,
              "interpolation": "bilinear", "to": "float", "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
              "train_augment": {"kind": "pad_crop_flip", "padding": 1}}


class TinyStaged(nn.Module):
    """stem (conv-BN-ReLU, 4 ch) -> block (conv-BN-ReLU, 8 ch) -> pool (GAP): 8-d features."""

    stage_names = ("stem", "block", "pool")
    name = "tiny-staged"
    feature_dim = 8

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.Identity()
        with torch.no_grad():  # non-trivial running statistics: eval and train mode differ
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.1, 0.1)
                    m.running_var.uniform_(0.5, 1.5)

    def stage(self, name: str) -> nn.Module:
        return getattr(self, name)

    def cut_points(self) -> tuple[str, ...]:
        return self.stage_names[:-1]

    def stage_output_shape(self, cut: str) -> tuple[int, ...]:
        return {"stem": (4, 8, 8), "block": (8, 8, 8)}[cut]

    def forward(self, x: torch.Tensor, start: str | None = None, stop: str | None = None) -> torch.Tensor:
        names = self.stage_names
        a = 0 if start is None else names.index(start) + 1
        b = len(names) if stop is None else names.index(stop) + 1
        for n in names[a:b]:
            x = x.mean(dim=(2, 3)) if n == "pool" else self.stage(n)(x)
        return x


class TinyBackbone(TorchBackbone):
    def trainable(self) -> TinyStaged:
        return copy.deepcopy(self.module).requires_grad_(True)


def _staged() -> TinyStaged:
    return TinyStaged(seed=0).eval()


def build(weights_dir=None, device: str = "cpu") -> TinyBackbone:
    net = _staged()
    return TinyBackbone("tiny-staged", net, weights_sha256=state_dict_sha256(net.state_dict()),
                        preprocess=dict(PREPROCESS), device=device)


register_backbone("tiny-staged", build, description="test double: tiny trainable staged CNN")


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_staged_store(root):
    """Three clients (domains a, b, c) of 3 classes, 9 images each, a saved manifest and a store
    of "tiny-staged" and its stem maps, extracted on the CPU: under CUDA extraction runs in bf16,
    and the tests compare float32 arithmetic. Returns the manifest (files under `root`:
    img/, manifest.json, s.zarr)."""
    from store_doubles import make_imagefolder, make_manifest

    from embedcache.extraction import ExtractConfig, extract
    from embedcache.manifest import save_manifest

    make_imagefolder(root / "img", domains=("a", "b", "c"), classes=("cat", "dog", "emu"), per_class=9, size=10)
    m = make_manifest(root / "img", test_every=3)
    save_manifest(m, root / "manifest.json")
    extract(m, ExtractConfig(backbones=("tiny-staged", "tiny-staged@stem"), store=str(root / "s.zarr"),
                             batch_size=64, progress=False, device="cpu"))
    return m


_KILL_SCRIPT = """
import live_doubles
from fedheads.finetuning.adapters.base import AdapterConfig
from fedheads.finetuning.algorithm import FTConfig
from fedheads.finetuning.runner import FinetuneOptions, finetune_run
opts = FinetuneOptions({options}, num_workers=0, progress=False, device="cpu", resume={resume})
finetune_run({manifest!r}, {store!r}, "tiny-staged", {out!r}, opts)
print("DONE", flush=True)
"""


def kill_after_round_2_then_resume(root, tmp_path, options: str):
    """A 4-round `finetune_run` on make_staged_store(root) with FinetuneOptions(`options`, ...):
    once uninterrupted (tmp_path/"ref"), once killed with -9 after round 2's checkpoint and resumed
    (tmp_path/"killed"); returns the two run directories."""
    import kill_helpers

    def script(out, resume: bool, delay: float) -> str:
        # killed in the sleep after round 2's checkpoint, before round 3
        return kill_helpers.stop_after("fedheads.finetuning.rounds:Checkpoint", "a[1][-1].round", 2, delay) + \
            _KILL_SCRIPT.format(options=options, manifest=str(root / "manifest.json"), store=str(root / "s.zarr"),
                                out=str(out), resume=resume)

    assert "DONE" in kill_helpers.run_script(script(tmp_path / "ref", False, 0.0), timeout=300).stdout
    kill_helpers.kill_at(script(tmp_path / "killed", False, 30.0), "ROUND 2")
    assert not (tmp_path / "killed" / "results.json").exists()
    done = kill_helpers.run_script(script(tmp_path / "killed", True, 0.0), timeout=300)
    assert "DONE" in done.stdout, done.stderr[-2000:]
    return tmp_path / "ref", tmp_path / "killed"
