"""Quantised ImageNet MobileNets run with LiteRT (``ai-edge-litert``, optional extra ``tflite``).

Files from google-coral/test_data (Apache-2.0) in ``<weights_dir>/coral_mobilenet/``:
  * ``mobilenet-v1-embed-tflite``: ``mobilenet_v1_1.0_224_quant_embedding_extractor.tflite``,
    whose output is the 1024-d pooled feature ``MobilenetV1/Logits/AvgPool_1a/AvgPool``;
  * ``mobilenet-v2-tflite``: ``mobilenet_v2_1.0_224_quant.tflite`` (1001-way classifier); the
    1280-d feature is the intermediate tensor ``MobilenetV2/Logits/AvgPool`` [1,1,1,1280], read
    from an interpreter built with ``experimental_preserve_all_tensors=True``.
Input is uint8 RGB [1, 224, 224, 3]; ``transform`` returns those 0..255 values as a float32
[3, 224, 224] tensor (exact integers) and ``embed`` casts back. Every uint8 output is
dequantised with its own (scale, zero_point).
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from embedcache.backbones import weights as W
from embedcache.backbones.base import Backbone, build_transform, check_batch, check_device
from embedcache.backbones.preprocessing import MILD_CROP, ImagePreprocessing
from embedcache.backbones.registry import register_backbone
from embedcache.errors import UserError

DECLARES = ("mobilenet-v1-embed-tflite", "mobilenet-v2-tflite")
SUBDIR = "coral_mobilenet"
_URL = "https://github.com/google-coral/test_data/raw/master/{}"
MODELS: dict[str, dict] = {
    "mobilenet-v1-embed-tflite": {
        "file": "mobilenet_v1_1.0_224_quant_embedding_extractor.tflite",
        "sha256": "f409ef4f73fcbb9667841965623c5c8524aac33d41b9bf5f3667161fb4a76319",
        "tensor": None,  # the model output is the embedding
        "dim": 1024,
        "what": "MobileNetV1 1.0/224 (ImageNet, uint8 quantised) embedding extractor",
    },
    "mobilenet-v2-tflite": {
        "file": "mobilenet_v2_1.0_224_quant.tflite",
        "sha256": "7aad0c74c5e3c06e5eb3c827e13304fdd68a83da6087d92ee169c24ff9fd4776",
        "tensor": "MobilenetV2/Logits/AvgPool",
        "dim": 1280,
        "what": "MobileNetV2 1.0/224 (ImageNet, uint8 quantised), pooled pre-logits",
    },
}

PREPROCESS = ImagePreprocessing(pipeline="tflite-uint8", input_size=(3, 224, 224), resize=(224, 224), to="uint8_float",
                                train_augment=MILD_CROP)


def _interpreter_cls():
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise UserError("ai-edge-litert is not installed: pip install 'fedfrozen[tflite]' "
                        "(or ai-edge-litert) to use the TFLite backbones") from None
    return Interpreter


def _dequant(arr: np.ndarray, quant: tuple[float, int]) -> np.ndarray:
    scale, zero = quant
    if scale == 0:  # not quantised
        return arr.astype(np.float32)
    return (arr.astype(np.float32) - np.float32(zero)) * np.float32(scale)


class TFLiteBackbone(Backbone):
    """One LiteRT interpreter, fed one image at a time (the models have a fixed batch of 1)."""

    def __init__(self, name: str, path: Path, digest: str, tensor: str | None, *, device: str = "cpu") -> None:
        self.name = name
        self.weights_sha256 = digest
        self.preprocessing = PREPROCESS.with_extra(model_file=path.name, feature_tensor=tensor or "output")
        self._tf = {t: build_transform(PREPROCESS, train=t) for t in (False, True)}
        Interpreter = _interpreter_cls()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # preserve_all_tensors warns that it is a debug option
            self._it = Interpreter(model_path=str(path), num_threads=torch.get_num_threads(),
                                   experimental_preserve_all_tensors=tensor is not None)
        self._it.allocate_tensors()
        self._lock = threading.Lock()  # an interpreter is not re-entrant
        self._in = self._it.get_input_details()[0]
        self._out = self._it.get_output_details()[0]
        if tuple(self._in["shape"]) != (1, 224, 224, 3) or self._in["dtype"] != np.uint8:
            raise UserError(f"{path}: expected a uint8 [1,224,224,3] input, got {self._in['dtype']} {self._in['shape']}")
        if tensor is None:
            self._feat = self._out
        else:
            found = [t for t in self._it.get_tensor_details() if t["name"] == tensor]
            if not found:
                raise UserError(f"{path}: has no tensor named {tensor!r}")
            self._feat = found[0]
        self.input_size = (3, 224, 224)
        self.to(device)
        self.feature_dim = int(self.embed(torch.zeros((1, *self.input_size))).shape[1])

    def transform(self, img: Image.Image, *, train: bool = False) -> torch.Tensor:
        return self._tf[train](img)

    def to(self, device: str) -> TFLiteBackbone:
        # LiteRT runs on the CPU whatever the device; accepting "cuda" keeps pipelines uniform.
        check_device(device, who=self.name)
        return self

    def _run(self, batch: torch.Tensor, detail: dict) -> torch.Tensor:
        check_batch(batch, self.input_size, who=self.name)
        x = batch.detach().cpu().round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        rows = []
        with self._lock:
            for i in range(x.shape[0]):
                self._it.set_tensor(self._in["index"], np.ascontiguousarray(x[i: i + 1]))
                self._it.invoke()
                raw = self._it.get_tensor(detail["index"])
                rows.append(_dequant(raw.reshape(1, -1), detail["quantization"]))
        return torch.from_numpy(np.concatenate(rows, axis=0))

    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        return self._run(batch, self._feat)

    def trainable(self):
        raise UserError(f"{self.name}: cannot be fine-tuned (a uint8-quantised TFLite graph run by LiteRT has "
                        "no trainable weights; efficientnet-lite0 is an ImageNet backbone that can)")

    def outputs(self, batch: torch.Tensor) -> torch.Tensor:
        """The model's own dequantised output (for v2: 1001 ImageNet class scores, index 0 =
        background)."""
        return self._run(batch, self._out)


def _factory(name: str, spec: dict):
    rel = f"{SUBDIR}/{spec['file']}"

    def build(weights_dir: Path | None, device: str) -> TFLiteBackbone:
        _interpreter_cls()  # fail on the missing package before looking for files
        path, digest = W.locate(rel, who=name, weights_dir=weights_dir, sha256=spec["sha256"],
                                url=_URL.format(spec["file"]))
        return TFLiteBackbone(name, path, digest, spec["tensor"], device=device)

    def probe(weights_dir: Path | None) -> tuple[bool, str]:
        try:
            _interpreter_cls()
        except UserError as exc:
            return False, str(exc)
        p = W.find_file(rel, weights_dir)
        if p is not None:
            return True, str(p)
        return False, f"not found in {W.looked_in(rel, weights_dir)}; downloadable from {_URL.format(spec['file'])}"

    return build, probe


for _name, _spec in MODELS.items():
    _build, _probe = _factory(_name, _spec)
    register_backbone(_name, _build, probe=_probe, source="tflite", feature_dim=_spec["dim"], cut_points=(),
                      description=f"{_spec['what']}; google-coral/test_data; {_spec['dim']}-d, LiteRT on CPU")
