"""Typed descriptions of how a backbone's input is made (contract 3): an image becomes a
``[C, H, W]`` tensor, a text a token batch.

A description is recorded with every shard as ``preprocess`` (its ``as_dict()``) and hashed into
the shard's cache key together with the weights, so a change to either is a cache miss, never a
stale hit. ``as_dict()`` therefore gives exactly the keys and values the store has always
recorded for the built-in backbones: a renamed key would re-extract every existing store.
``extra`` holds settings that are recorded but do not build the tensors (architecture notes,
library versions, the cut of a cut backbone...).

A backbone may also describe its preprocessing as a plain dict (:class:`RecordedPreprocessing`,
recorded verbatim): custom backbones written before the typed descriptions keep their cache keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from embedcache.errors import UserError

INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


class _Items(tuple):
    """A dict's items, frozen (told apart from a list of pairs when the record is written)."""


def _plain(v: Any) -> Any:
    """Tuples as lists, recursively: the record is JSON (what the store reads back)."""
    if isinstance(v, _Items):
        return {k: _plain(x) for k, x in v}
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _frozen(v: Any) -> Any:
    """Lists as tuples, dicts as their frozen items: field values that cannot change."""
    if isinstance(v, Mapping):
        return _Items((k, _frozen(x)) for k, x in v.items())
    if isinstance(v, (tuple, list)):
        return tuple(_frozen(x) for x in v)
    return v


@dataclass(frozen=True)
class Preprocessing:
    """Base of the descriptions: `as_dict()` is the record (own fields, then `extra`)."""

    extra: tuple[tuple[str, Any], ...] = field(default=(), kw_only=True)  # recorded, not used to build tensors

    def _own(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "extra"}

    def as_dict(self) -> dict[str, Any]:
        return {**self._own(), **{k: _plain(v) for k, v in self.extra}}

    def with_extra(self, **more: Any) -> Preprocessing:
        """The same description with more recorded settings (later keys win)."""
        merged = dict(self.extra)
        merged.update({k: _frozen(v) for k, v in more.items()})
        return replace(self, extra=tuple(merged.items()))


@dataclass(frozen=True)
class TrainAugment:
    """The random view `transform(img, train=True)` draws (multi-view extraction, fine-tuning)."""

    kind: str = "none"  # "none" | "pad_crop_flip" | "affine" | "random_resized_crop_flip"
    padding: int | None = None  # pad_crop_flip: pixels of padding before the random crop
    degrees: float | None = None  # affine: rotation range
    translate: tuple[float, float] | None = None  # affine: fraction of width/height
    scale: tuple[float, float] | None = None  # affine / random_resized_crop_flip: scale range
    ratio: tuple[float, float] | None = None  # random_resized_crop_flip: aspect-ratio range

    def as_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> TrainAugment:
        d = dict(d or {"kind": "none"})
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise UserError(f"train_augment: unknown key(s) {sorted(unknown)}")
        return cls(**{k: _frozen(v) for k, v in d.items()})


MILD_CROP = TrainAugment("random_resized_crop_flip", scale=(0.6, 1.0), ratio=(0.75, 1.3333333333333333))
"""The training view this project uses for every ImageNet backbone: a mild random crop and a flip
(fine-tuning on small transfer sets, not ImageNet's from-scratch scale 0.08-1)."""


@dataclass(frozen=True)
class ImagePreprocessing(Preprocessing):
    """An image through the torchvision pipeline `embedcache.backbones.base.build_transform` builds:
    RGB, resize, optional centre crop, then ToTensor + Normalize (or 0..255 kept as floats)."""

    input_size: tuple[int, int, int]  # [C, H, W] of the tensor embed() takes
    resize: tuple[int, int] | int  # exact (H, W), or the shorter side
    crop: tuple[int, int] | None = None  # centre crop after the resize
    interpolation: str = "bilinear"  # "bilinear" | "bicubic" | "nearest"
    to: str = "float"  # "float": ToTensor, [0, 1]; "uint8_float": 0..255 values kept as float32
    mean: tuple[float, ...] | None = None  # Normalize after ToTensor; None: no normalisation
    std: tuple[float, ...] | None = None
    train_augment: TrainAugment = TrainAugment()  # the random training view
    pipeline: str = "torchvision"  # recorded name of the pipeline ("torchvision", "tflite-uint8")

    def __post_init__(self) -> None:
        if self.interpolation not in INTERPOLATIONS:
            raise UserError(f"interpolation {self.interpolation!r}: must be one of {', '.join(INTERPOLATIONS)}")
        if self.to not in ("float", "uint8_float"):
            raise UserError(f"to {self.to!r}: must be float or uint8_float")
        if len(self.input_size) != 3:
            raise UserError(f"input_size {list(self.input_size)}: must be [C, H, W]")

    def _own(self) -> dict[str, Any]:
        own = super()._own()
        own["train_augment"] = self.train_augment.as_dict()
        order = ("pipeline", "input_size", "resize", "crop", "interpolation", "to", "mean", "std", "train_augment")
        return {k: own[k] for k in order}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ImagePreprocessing:
        """The description a preprocess dict gives (keys as `as_dict` writes them; `crop`, `to`,
        `mean`, `std`, `train_augment` may be left out; other keys go to `extra`)."""
        missing = [k for k in ("input_size", "resize", "interpolation") if k not in d]
        if missing:
            raise UserError(f"preprocess: missing {', '.join(missing)}")
        own = {f.name for f in fields(cls)} - {"extra", "train_augment"}
        return cls(**{k: _frozen(v) for k, v in d.items() if k in own},
                   train_augment=TrainAugment.from_dict(d.get("train_augment")),
                   extra=tuple((k, _frozen(v)) for k, v in d.items() if k not in own and k != "train_augment"))


@dataclass(frozen=True)
class TimmPreprocessing(Preprocessing):
    """An image through timm's own transforms (`resolve_model_data_config` + `create_transform`)."""

    timm_version: str  # timm's transforms may change between versions: part of the cache key
    data_config: tuple[tuple[str, Any], ...]  # resolve_model_data_config(model): input_size, mean, std, crop...
    train_augment: tuple[tuple[str, Any], ...]  # create_transform's training arguments (scale, ratio, hflip...)

    @property
    def input_size(self) -> tuple[int, int, int]:
        return tuple(dict(self.data_config)["input_size"])  # type: ignore[return-value]

    def _own(self) -> dict[str, Any]:
        cfg = dict(self.data_config)
        return {"pipeline": "timm", "timm_version": self.timm_version, "input_size": _plain(cfg.pop("input_size")),
                **{k: _plain(v) for k, v in cfg.items()}, "train_augment": _plain(dict(self.train_augment))}


@dataclass(frozen=True)
class TextPreprocessing(Preprocessing):
    """A text through a WordPiece tokenizer into at most `max_length` tokens (contract 3d)."""

    tokenizer: str  # which tokenizer (its vocabulary and rules)
    tokenizer_sha256: str  # sha256 of its tokenizer.json
    max_length: int  # T: longer texts are truncated, [CLS]/[SEP] included
    padding: str  # how a batch is padded
    pooling: str  # how token states become one feature
    normalize: str  # what the pooled feature is normalised by
    architecture: str  # the encoder, for the record

    def _own(self) -> dict[str, Any]:
        return {"modality": "text", **super()._own()}


@dataclass(frozen=True)
class RecordedPreprocessing(Preprocessing):
    """A preprocess dict given as such (a custom backbone's), recorded verbatim."""

    items: tuple[tuple[str, Any], ...]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RecordedPreprocessing:
        return cls(tuple((k, _frozen(v)) for k, v in d.items()))

    def _own(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in self.items}


def as_preprocessing(value: Preprocessing | Mapping[str, Any]) -> Preprocessing:
    """A description as given, or a dict recorded verbatim."""
    return value if isinstance(value, Preprocessing) else RecordedPreprocessing.from_dict(value)


def image_preprocessing(value: Preprocessing | Mapping[str, Any]) -> ImagePreprocessing:
    """The torchvision pipeline a description (or a preprocess dict) asks for."""
    if isinstance(value, ImagePreprocessing):
        return value
    return ImagePreprocessing.from_dict(value.as_dict() if isinstance(value, Preprocessing) else value)


def preprocessing_of(backbone: Any) -> Preprocessing:
    """A backbone's description (one that only sets a `preprocess` dict: that dict, verbatim)."""
    own = getattr(backbone, "preprocessing", None)
    return own if isinstance(own, Preprocessing) else as_preprocessing(backbone.preprocess)
