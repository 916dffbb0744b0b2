"""The backbone contract (docs/contracts.md section 3) and the shared torch machinery.

A :class:`Backbone` maps preprocessed images ``[B, C, H, W]`` to pooled features ``[B, D]``
(FedPCL Sec. 3, the frozen encoder r_k(x; phi_k*) whose outputs are concatenated in Eq. 1-2).
It is always used frozen: eval mode (BatchNorm on running statistics), inference mode.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from embedcache.backbones.preprocessing import ImagePreprocessing, Preprocessing, as_preprocessing, image_preprocessing
from embedcache.errors import UserError
from embedcache.pixels import to_rgb8
from embedcache.tensor_digest import state_dict_sha256  # noqa: F401 - where the backbones import it from

if TYPE_CHECKING:
    from embedcache.backbones.staged import StagedNet

_INTERP = {"bilinear": "BILINEAR", "bicubic": "BICUBIC", "nearest": "NEAREST"}


class Backbone(ABC):
    """A frozen feature extractor. Subclasses set ``name``, ``feature_dim``, ``weights_sha256``
    and ``preprocessing`` (or assign a plain dict to ``preprocess``) in ``__init__``."""

    name: str
    feature_dim: int
    weights_sha256: str
    preprocessing: Preprocessing  # how inputs become tensors (embedcache.backbones.preprocessing)
    modality: str = "image"  # "text": embed() takes token batches (embedcache.backbones.text)

    @property
    def preprocess(self) -> dict:
        """The preprocessing as recorded with every shard and hashed into its cache key."""
        return self.preprocessing.as_dict()

    @preprocess.setter
    def preprocess(self, value: Preprocessing | Mapping[str, Any]) -> None:
        self.preprocessing = as_preprocessing(value)

    @abstractmethod
    def transform(self, img: Image.Image, *, train: bool = False) -> torch.Tensor:
        """PIL image -> ``[C, H, W]`` float32; ``train=True`` gives one random augmented view."""

    @abstractmethod
    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> ``[B, D]`` float32 on the CPU."""

    @abstractmethod
    def to(self, device: str) -> Backbone:
        """Move to ``device`` ("cpu", "cuda", "cuda:1"); returns self."""

    def trainable(self) -> StagedNet:
        """A fresh trainable deep copy of the network as ordered stages (contract 3a); train/eval
        is the caller's. Backbones without trainable torch weights say why in one line."""
        raise UserError(f"{self.name}: cannot be fine-tuned (not a torch network with trainable weights)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, feature_dim={self.feature_dim})"


def check_device(device: str, *, who: str) -> torch.device:
    """embedcache.devices.resolve_device, with the backbone named in the error."""
    from embedcache.devices import resolve_device

    try:
        return resolve_device(device)
    except UserError as exc:
        raise UserError(f"{who}: {exc}") from None


def check_batch(batch: torch.Tensor, input_size: tuple[int, int, int], *, who: str) -> None:
    if not isinstance(batch, torch.Tensor) or batch.ndim != 4 or tuple(batch.shape[1:]) != tuple(input_size):
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise UserError(f"{who}: embed() wants a [B, {', '.join(map(str, input_size))}] tensor, got {shape}")
    if batch.shape[0] == 0:
        raise UserError(f"{who}: embed() got an empty batch")


def strip_prefix(state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return dict(state)


def load_strict(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, who: str,
                ignore: tuple[str, ...] = ()) -> list[str]:
    """Load ``state`` asserting every key of ``model`` is matched with the right shape.

    Checkpoint keys that start with one of ``ignore`` (e.g. the classifier ``linear.``) are
    dropped and returned; any other unexpected or missing key is a UserError. (FedPCL's code
    loads with ``strict=False``, which can silently load nothing.)
    """
    dropped = sorted(k for k in state if k.startswith(ignore)) if ignore else []
    kept = {k: v for k, v in state.items() if k not in set(dropped)}
    own = model.state_dict()
    # Checkpoints saved before PyTorch 0.4.1 lack BatchNorm's num_batches_tracked counter; it
    # plays no part in eval mode, so the model's own value is kept.
    for k in own:
        if k.endswith("num_batches_tracked") and k not in kept:
            kept[k] = own[k]
    missing = sorted(set(own) - set(kept))
    unexpected = sorted(set(kept) - set(own))
    bad_shape = sorted(k for k in set(own) & set(kept) if tuple(own[k].shape) != tuple(kept[k].shape))
    if missing or unexpected or bad_shape:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", bad_shape)):
            if keys:
                more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
                parts.append(f"{label} keys {keys[:5]}{more}")
        raise UserError(f"{who}: checkpoint does not match the architecture: {'; '.join(parts)}")
    model.load_state_dict(kept, strict=True)
    return dropped


def build_transform(spec: ImagePreprocessing | Mapping[str, Any], *, train: bool):
    """The torchvision pipeline of an image preprocessing description (or of a preprocess dict
    with the same keys): RGB first, then resize, centre crop, the training view when ``train``,
    and ToTensor + Normalize (or 0..255 kept as float32)."""
    from torchvision import transforms as T

    pre = image_preprocessing(spec)
    interp = getattr(T.InterpolationMode, _INTERP[pre.interpolation])
    size = tuple(pre.input_size[1:])
    aug = pre.train_augment
    ops: list = [T.Lambda(_to_rgb)]  # grey / palette / RGBA inputs become 3-channel RGB
    if train and aug.kind == "random_resized_crop_flip":
        ops += [T.RandomResizedCrop(size, scale=tuple(aug.scale), ratio=tuple(aug.ratio), interpolation=interp),
                T.RandomHorizontalFlip(0.5)]
    else:
        resize = pre.resize
        ops.append(T.Resize(tuple(resize) if isinstance(resize, (list, tuple)) else int(resize), interpolation=interp))
        if pre.crop:
            ops.append(T.CenterCrop(tuple(pre.crop)))
        if train and aug.kind == "pad_crop_flip":
            ops += [T.RandomCrop(size, padding=int(aug.padding)), T.RandomHorizontalFlip(0.5)]
        elif train and aug.kind == "affine":
            ops.append(T.RandomAffine(degrees=float(aug.degrees), translate=tuple(aug.translate),
                                      scale=tuple(aug.scale), interpolation=interp))
        elif train and aug.kind != "none":
            raise UserError(f"train_augment: unknown kind {aug.kind!r}")
    if pre.to == "uint8_float":
        ops += [T.PILToTensor(), T.Lambda(_as_float)]
    else:
        ops.append(T.ToTensor())
        if pre.mean is not None:
            ops.append(T.Normalize(tuple(pre.mean), tuple(pre.std)))
    return T.Compose(ops)


def _to_rgb(img: Image.Image) -> Image.Image:
    return to_rgb8(img)  # 16-bit pixels scaled, not clipped


def _as_float(t: torch.Tensor) -> torch.Tensor:
    # uint8 0..255 kept as exact float32 values (ConvertImageDtype would rescale to [0, 1]).
    return t.to(torch.float32)


def cuda_autocast(device: torch.device):
    """Autocast on CUDA (bfloat16 where supported, else float16); a no-op context elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.autocast(device_type="cuda", dtype=dtype)


class TorchBackbone(Backbone):
    """A frozen ``nn.Module`` whose forward returns pooled features ``[B, D]``.

    On CUDA the module runs channels_last under autocast (bfloat16 where supported, else
    float16); the output is always float32 on the CPU. ``feature_dim`` is measured on a dummy
    batch rather than trusted from metadata (timm's ``num_features`` is not always the pooled size).
    """

    def __init__(self, name: str, module: torch.nn.Module, *, weights_sha256: str,
                 preprocess: Preprocessing | Mapping[str, Any], device: str = "cpu", transform_fn=None) -> None:
        self.name = name
        self.weights_sha256 = weights_sha256
        self.preprocess = preprocess
        self.input_size: tuple[int, int, int] = tuple(self.preprocess["input_size"])  # type: ignore[assignment]
        self._module = module.eval().requires_grad_(False)
        self._transform_fn = transform_fn  # (img, train) -> tensor, when not built from the dict
        self._tf_cache: dict[bool, Any] = {}
        self._device = torch.device("cpu")
        self.to(device)
        self.feature_dim = int(self.embed(torch.zeros((2, *self.input_size))).shape[1])

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    def trainable(self) -> StagedNet:
        """A deep copy of the module as a StagedNet (CPU, eval mode, every parameter trainable)."""
        from embedcache.backbones.staged import staged_from_module

        return staged_from_module(self.name, self._module, input_size=self.input_size)

    def transform(self, img: Image.Image, *, train: bool = False) -> torch.Tensor:
        if self._transform_fn is not None:
            out = self._transform_fn(img, train)
        else:
            if train not in self._tf_cache:
                self._tf_cache[train] = build_transform(self.preprocessing, train=train)
            out = self._tf_cache[train](img)
        return out.to(torch.float32)

    def to(self, device: str) -> TorchBackbone:
        dev = check_device(device, who=self.name)
        self._module.to(dev)
        if dev.type == "cuda":
            self._module.to(memory_format=torch.channels_last)
        self._device = dev
        return self

    def _autocast(self):
        return cuda_autocast(self._device)

    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        check_batch(batch, self.input_size, who=self.name)
        self._module.eval()
        with torch.inference_mode(), self._autocast():
            x = batch.to(self._device, dtype=torch.float32, non_blocking=True)
            if self._device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            out = self._module(x)
        out = out.reshape(out.shape[0], -1).float().cpu()
        return out


class CpuChannelsLastBackbone(TorchBackbone):
    """A TorchBackbone that also runs channels-last on the CPU when ``cpu_channels_last`` is set
    (depthwise-convolution networks such as EfficientNet-Lite0 embed ~2x faster that way).
    The attribute must be set before ``TorchBackbone.__init__`` runs (class attribute or first line)."""

    cpu_channels_last: bool = False

    def to(self, device: str) -> CpuChannelsLastBackbone:
        super().to(device)
        if self.cpu_channels_last:
            self._module.to(memory_format=torch.channels_last)
        return self

    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        if self.cpu_channels_last and isinstance(batch, torch.Tensor) and batch.ndim == 4:
            batch = batch.contiguous(memory_format=torch.channels_last)
        return super().embed(batch)
