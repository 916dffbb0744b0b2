"""``digitnet-builtin``: a small CNN the project pre-trains itself, so that the embedded
``builtin:digits`` data set has a working backbone on a machine with no downloaded weights.

It is NOT a published checkpoint: it is trained locally, deterministically, on data disjoint
from every client's images: SynthDigits-style renderings from
``render_synth_digits(n, seed=10_000)`` (the client-facing synthetic domain uses
``SYNTH_SEED`` = 20152; seeds 10_000-10_002 are reserved here for train / backgrounds /
validation), half of them blended MNIST-M style (``|patch - image|``) over random patches
of the two photographs scikit-learn ships.

The default recipe's trunk ships with the package (``assets/digitnet-builtin-<recipe hash>.pt``,
made by :func:`make_shipped_weights`, its sha256 pinned in ``SHIPPED_SHA256`` and checked on every
load, loaded with ``weights_only=True``), so no first run pre-trains. Where it is looked up: a
weights directory (``--weights-dir``, ``$EMBEDCACHE_WEIGHTS``, ``../shared/weights``: a copy there
wins), then the packaged file. Any other recipe is trained on first use and cached as
``<cache>/weights/digitnet-builtin-<recipe hash>.pt`` (atomic write). The file's sha256 is the
backbone's ``weights_sha256``. The recipe is bit-reproducible on one machine (fixed seeds, 2
threads, deterministic algorithms); a test retrains it and compares with the shipped tensors.

Architecture: 4 blocks of conv3x3-BN-ReLU (32, 64, 96, 128 channels), 2x2 max-pool after the
first three, global average pool -> 128-d. Input 32x32 RGB normalised to [-1, 1].
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embedcache.atomic import write_bytes
from embedcache.backbones import weights as W
from embedcache.backbones.base import TorchBackbone, load_strict
from embedcache.backbones.preprocessing import ImagePreprocessing, TrainAugment
from embedcache.backbones.registry import register_backbone
from embedcache.errors import UserError

log = logging.getLogger(__name__)
NAME = "digitnet-builtin"
PROVENANCE = "pre-trained locally on synthetic digits (not a published checkpoint)"


@dataclass(frozen=True)
class DigitNetRecipe:
    """Everything that determines the trained weights; its hash names the cache file."""

    n_train: int = 5000  # rendered training digits
    n_val: int = 1000  # rendered validation digits (accuracy is logged and stored)
    seed: int = 10_000  # render seed of the training digits (clients use 20152)
    background_seed: int = 10_001  # photo patches and which images get them
    val_seed: int = 10_002  # render seed of the validation digits
    photo_fraction: float = 0.5  # share of images blended over a photo patch
    epochs: int = 4  # passes over the training set
    batch_size: int = 128  # SGD mini-batch
    lr: float = 0.1  # peak learning rate of the one-cycle schedule
    momentum: float = 0.9  # SGD (Nesterov) momentum
    weight_decay: float = 5e-4  # L2 on all parameters
    shift: int = 3  # random translation (pixels) as training augmentation
    widths: tuple[int, ...] = (32, 64, 96, 128)  # channels of the four conv blocks
    threads: int = 2  # torch intra-op threads while training (fixed for reproducibility)
    version: int = 1  # bump when the training code changes

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


DEFAULT_RECIPE = DigitNetRecipe()
SHIPPED_RECIPE = DigitNetRecipe()  # the packaged file's recipe (DEFAULT_RECIPE is the one in use; tests swap it)
ASSETS = Path(__file__).with_name("assets")  # package data (pyproject.toml)
# sha256 of the shipped file: a changed or truncated copy is refused, never used
SHIPPED_SHA256 = "6b29c845e8b310e09450b68e3ed40111e5fec79b3ef94092a553d16b02632035"

DECLARES = ("digitnet-builtin",)

PREPROCESS = ImagePreprocessing(
    input_size=(3, 32, 32), resize=(32, 32), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
    train_augment=TrainAugment("affine", degrees=10.0, translate=(0.1, 0.1), scale=(0.9, 1.1)),
)


class DigitNet(nn.Module):
    """Trunk returning the 128-d pooled feature (no classifier)."""

    def __init__(self, widths: tuple[int, ...] = DEFAULT_RECIPE.widths) -> None:
        super().__init__()
        blocks, cin = [], 3
        for i, w in enumerate(widths):
            layers = [nn.Conv2d(cin, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
            if i < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
            blocks.append(nn.Sequential(*layers))
            cin = w
        self.features = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).mean(dim=(2, 3))

    def stage_layout(self) -> list[tuple[str, nn.Module]]:
        """Contract 3a layout: block1..blockN (one per conv block), pool."""
        from embedcache.backbones.staged import GlobalMean

        return [(f"block{i + 1}", b) for i, b in enumerate(self.features)] + [("pool", GlobalMean())]


def _photos() -> list[np.ndarray]:
    from sklearn.datasets import load_sample_images

    return [np.asarray(im, dtype=np.uint8) for im in load_sample_images().images]


def pretraining_data(n: int, seed: int, background_seed: int, photo_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Rendered digits, a ``photo_fraction`` of them blended over photo patches; uint8 [n,32,32,3]."""
    from embedcache.sources.builtin_digits import SYNTH_SEED, render_synth_digits

    if SYNTH_SEED in (seed, background_seed):
        raise UserError(f"{NAME}: seed {SYNTH_SEED} is the clients' synthetic domain; pre-training must not use it")
    images, labels = render_synth_digits(n, seed, 32)
    rng = np.random.default_rng(background_seed)
    photos = _photos()
    out = images.astype(np.int16)
    for i in np.flatnonzero(rng.random(n) < photo_fraction):
        ph = photos[int(rng.integers(len(photos)))]
        y, x = int(rng.integers(ph.shape[0] - 32)), int(rng.integers(ph.shape[1] - 32))
        out[i] = np.abs(ph[y: y + 32, x: x + 32].astype(np.int16) - out[i])
    return out.astype(np.uint8), labels


def _to_input(images: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255.0)
    return (x - 0.5) / 0.5  # the same Normalize(0.5, 0.5) as PREPROCESS


def _shift(x: torch.Tensor, s: int, gen: torch.Generator) -> torch.Tensor:
    if s <= 0:
        return x
    pad = F.pad(x, (s, s, s, s), mode="replicate")
    dy, dx = torch.randint(0, 2 * s + 1, (2,), generator=gen).tolist()
    return pad[:, :, dy: dy + x.shape[2], dx: dx + x.shape[3]]


def train_digitnet(recipe: DigitNetRecipe = DEFAULT_RECIPE) -> tuple[dict[str, torch.Tensor], dict]:
    """Train deterministically; returns (trunk state_dict, report with accuracies and time)."""
    from embedcache.progress import bar as tqdm

    t0 = time.perf_counter()
    xs, ys = pretraining_data(recipe.n_train, recipe.seed, recipe.background_seed, recipe.photo_fraction)
    xv, yv = pretraining_data(recipe.n_val, recipe.val_seed, recipe.background_seed + 2, recipe.photo_fraction)
    x, y, x_val, y_val = _to_input(xs), torch.from_numpy(ys), _to_input(xv), torch.from_numpy(yv)
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
            torch.manual_seed(recipe.seed)
            gen = torch.Generator().manual_seed(recipe.seed)
            trunk = DigitNet(recipe.widths)
            head = nn.Linear(recipe.widths[-1], 10)
            params = list(trunk.parameters()) + list(head.parameters())
            opt = torch.optim.SGD(params, lr=recipe.lr, momentum=recipe.momentum, nesterov=True,
                                  weight_decay=recipe.weight_decay)
            steps = recipe.epochs * ((len(x) + recipe.batch_size - 1) // recipe.batch_size)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=steps)
            trunk.train()
            bar = tqdm(total=steps, desc=f"{NAME}: pre-training on synthetic digits", leave=False)
            for _ in range(recipe.epochs):
                order = torch.randperm(len(x), generator=gen)
                for i in range(0, len(x), recipe.batch_size):
                    idx = order[i: i + recipe.batch_size]
                    loss = F.cross_entropy(head(trunk(_shift(x[idx], recipe.shift, gen))), y[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.close()
            trunk.eval()
            with torch.inference_mode():
                val_acc = float((head(trunk(x_val)).argmax(1) == y_val).float().mean())
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)
    report = {"val_accuracy": val_acc, "seconds": round(time.perf_counter() - t0, 1),
              "torch_version": str(torch.__version__)}
    return {k: v.detach().clone() for k, v in trunk.state_dict().items()}, report


def weights_file(recipe: DigitNetRecipe = DEFAULT_RECIPE) -> str:
    return f"{NAME}-{recipe.digest()}.pt"


def shipped_weights(recipe: DigitNetRecipe = DEFAULT_RECIPE) -> Path | None:
    """The packaged trunk of `recipe`, its sha256 checked (None: no file ships for this recipe)."""
    if recipe != SHIPPED_RECIPE:
        return None
    path = ASSETS / weights_file(SHIPPED_RECIPE)
    if not path.is_file():
        raise UserError(f"{path}: {NAME}'s packaged weights are missing (a broken install? reinstall the package)")
    W.verify_sha256(path, SHIPPED_SHA256)
    return path


def save_weights(state: dict[str, torch.Tensor], report: dict, recipe: DigitNetRecipe, dest: Path) -> Path:
    """The checkpoint file: trunk state_dict, recipe, report and provenance, written atomically."""
    buf = io.BytesIO()  # saved in memory: the archive's inner name is then fixed, not the file's
    torch.save({"state_dict": state, "recipe": {**asdict(recipe), "widths": list(recipe.widths)},
                "report": report, "provenance": PROVENANCE}, buf)
    write_bytes(dest, buf.getvalue())
    return dest


def make_shipped_weights(dest: Path | None = None) -> tuple[Path, str]:
    """Train the default recipe and write the file that ships (run once per recipe change:
    ``python -c "from embedcache.backbones import digitnet; print(digitnet.make_shipped_weights())"``,
    then pin the printed sha256 in SHIPPED_SHA256). The report keeps the validation accuracy and
    the torch version, not the time taken, so that the file depends on the weights only."""
    state, report = train_digitnet(SHIPPED_RECIPE)
    dest = ASSETS / weights_file(SHIPPED_RECIPE) if dest is None else Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    save_weights(state, {k: report[k] for k in ("val_accuracy", "torch_version")}, SHIPPED_RECIPE, dest)
    return dest, W.sha256_file(dest)


def ensure_weights(recipe: DigitNetRecipe = DEFAULT_RECIPE, weights_dir: Path | None = None) -> Path:
    """Path of the trunk: a weights directory's copy, else the packaged file (default recipe), else
    the cached one, training and caching it first if no copy exists.

    Several processes (e.g. extraction workers) may ask at once: an exclusive lock on
    ``<file>.lock`` makes exactly one of them train while the others wait and then reuse it.
    """
    fname = weights_file(recipe)
    given = W.resolve_weights_dir(weights_dir) / fname
    # a named directory's copy wins (--weights-dir, even the cache: e.g. a copy trained before the
    # weights shipped, which earlier stores were extracted with); the cache as a mere fallback does not
    if given.is_file() and (weights_dir is not None or given.parent != W.cache_weights_dir()):
        return given
    shipped = shipped_weights(recipe)
    if shipped is not None:
        return shipped
    found = W.find_file(fname, weights_dir)
    if found is not None:
        return found
    dest = W.cache_weights_dir() / fname
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.with_name(fname + ".lock"), "w") as lock:
        _lock(lock)
        if dest.is_file():  # another process finished while we waited
            return dest
        log.warning("%s: no cached weights (%s); %s now (recipe %s)", NAME, W.looked_in(fname, weights_dir),
                    PROVENANCE, recipe.digest())
        state, report = train_digitnet(recipe)
        log.warning("%s: %s; validation accuracy %.3f on held-out renderings, %.1f s", NAME, PROVENANCE,
                    report["val_accuracy"], report["seconds"])
        save_weights(state, report, recipe, dest)
    return dest


def _lock(f) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: no advisory lock; at worst two processes train the same file
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


def load_digitnet(path: Path, recipe: DigitNetRecipe = DEFAULT_RECIPE, *, device: str = "cpu") -> TorchBackbone:
    ckpt = W.load_torch(path, who=NAME)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise UserError(f"{path}: not a {NAME} checkpoint (no 'state_dict')")
    model = DigitNet(recipe.widths)
    load_strict(model, ckpt["state_dict"], who=f"{NAME} ({path})")
    pre = PREPROCESS.with_extra(recipe=recipe.digest(), provenance=PROVENANCE)
    return TorchBackbone(NAME, model, weights_sha256=W.sha256_file(path), preprocess=pre, device=device)


def _build(weights_dir: Path | None, device: str) -> TorchBackbone:
    return load_digitnet(ensure_weights(DEFAULT_RECIPE, weights_dir), DEFAULT_RECIPE, device=device)


def _probe(weights_dir: Path | None) -> tuple[bool, str]:
    fname = weights_file(DEFAULT_RECIPE)
    given = W.resolve_weights_dir(weights_dir) / fname
    if given.is_file() and (weights_dir is not None or given.parent != W.cache_weights_dir()):  # as ensure_weights
        return True, f"{given} ({PROVENANCE})"
    if DEFAULT_RECIPE == SHIPPED_RECIPE and (ASSETS / fname).is_file():
        return True, f"shipped with the package: {ASSETS / fname} ({PROVENANCE})"
    p = W.find_file(fname, weights_dir)
    if p is not None:
        return True, f"{p} ({PROVENANCE})"
    return True, f"not cached yet: trained on first use (about a minute of CPU) into {W.cache_weights_dir()}"


register_backbone(NAME, _build, probe=_probe, source="builtin", feature_dim=DEFAULT_RECIPE.widths[-1],
                  cut_points=tuple(f"block{i + 1}" for i in range(len(DEFAULT_RECIPE.widths))),
                  description=f"small 4-block CNN, 128-d, 32x32 input; {PROVENANCE}")
