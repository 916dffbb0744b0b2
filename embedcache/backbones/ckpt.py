"""`ckpt:<path>`: a fine-tuned network as a backbone (docs/contracts.md section 3f).

Fine-tuning (`fedheads finetune`, FedDRA's stage 2) changes a backbone's weights; caching the
features of the result is then one `embedcache extract --backbones ckpt:RUN_DIR/...pt`. The file
names the base backbone (its architecture, preprocessing and stage layout) and holds the whole
StagedNet state dict, so the backbone is the base's StagedNet with those weights, keyed by the
file's sha256 like any weights file. A text base (FedDRA's trained text encoder) gives a
TextBackbone with the base's tokenizer, so `ckpt:<file>@<cut>` caches its token states.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from embedcache.atomic import write_bytes
from embedcache.backbones.base import Backbone, CpuChannelsLastBackbone, TorchBackbone, load_strict, state_dict_sha256
from embedcache.backbones.cut import _BoundTransform
from embedcache.backbones.preprocessing import preprocessing_of
from embedcache.backbones.registry import BackboneInfo, create_backbone, register_family
from embedcache.errors import UserError

DECLARES = ("ckpt:<path>",)
FORMAT = "embedcache-ckpt-backbone/1"
PREFIX = "ckpt:"


def _check_base(base: Any, who: str) -> str:
    if not isinstance(base, str) or not base or "@" in base or base.startswith(PREFIX):
        raise UserError(f"{who}: base {base!r} must be the registry name of a backbone (no @cut, not ckpt:)")
    return base


def save_backbone_checkpoint(path: str | os.PathLike, base: str, staged: nn.Module, note: str = "") -> str:
    """Write `staged`'s weights as a `ckpt:` file for backbone `base` (atomically: a temp file,
    then rename); returns the file's sha256. The same weights, base and note give the same bytes.
    `digest` (the weights' state_dict_sha256) lets a reader tell a corrupted file from a trained one."""
    path = Path(path)
    _check_base(base, str(path))
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in staged.state_dict().items()}
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "base": base, "state_dict": state, "note": str(note),
                "digest": state_dict_sha256(state)}, buf)
    data = buf.getvalue()
    write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def read_backbone_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(the checked blob, sha256 of the bytes it was loaded from); UserError naming the file."""
    path = Path(path)
    who = f"{PREFIX}{path}"
    if not path.is_file():
        raise UserError(f"{who}: checkpoint file not found")
    data = path.read_bytes()  # hash and load the same bytes: no race with a writer
    try:
        blob = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(f"{who}: not a readable torch checkpoint ({type(exc).__name__})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        got = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise UserError(f"{who}: not an {FORMAT} file (format {got!r}; written by fedheads finetune as "
                        f"RUN_DIR/state/seed<S>.backbone.pt)")
    _check_base(blob.get("base"), who)
    state = blob.get("state_dict")
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise UserError(f"{who}: state_dict must map parameter names to tensors")
    if "digest" in blob and blob["digest"] != state_dict_sha256(state):  # files written before carry none
        raise UserError(f"{who}: corrupt (its weights do not match the digest written with them); "
                        "export it again (re-run the fine-tuning that wrote it)")
    return blob, hashlib.sha256(data).hexdigest()


class CkptBackbone(CpuChannelsLastBackbone):
    """The base backbone's StagedNet with the checkpoint's weights; embed = its forward."""

    def __init__(self, name: str, base: Backbone, staged: nn.Module, *, weights_sha256: str,
                 note: str, device: str = "cpu") -> None:
        self.cpu_channels_last = bool(getattr(base, "cpu_channels_last", False))  # before __init__
        self.base_name, self.note = base.name, note
        # the base's own transform when it has one (timm), else the same pipeline from its description
        transform_fn = base._transform_fn if isinstance(base, TorchBackbone) else _BoundTransform(base)
        super().__init__(name, staged, weights_sha256=weights_sha256, preprocess=preprocessing_of(base),
                         device=device, transform_fn=transform_fn)
        if self.feature_dim != base.feature_dim:
            raise UserError(f"{name}: the checkpoint's network gives {self.feature_dim}-d features, "
                            f"{base.name} {base.feature_dim}-d")

    def trainable(self) -> nn.Module:
        """A deep copy of the fine-tuned StagedNet (contract 3a: CPU, default memory format, every
        parameter trainable, eval mode), named like this backbone."""
        net = copy.deepcopy(self.module).to("cpu", memory_format=torch.contiguous_format)
        net.name = self.name
        return net.requires_grad_(True).eval()


def create_ckpt(name: str, weights_dir: str | os.PathLike | None, device: str) -> CkptBackbone:
    """`ckpt:<path>` (contract 3f): the file's base backbone with the file's weights."""
    path = name[len(PREFIX):]
    if not path:
        raise UserError(f"{name}: name a checkpoint file, ckpt:<path> (e.g. ckpt:runs/ft/state/seed0.backbone.pt)")
    blob, sha = read_backbone_checkpoint(path)
    try:
        base = create_backbone(blob["base"], weights_dir=weights_dir, device="cpu")
        staged = base.trainable()
    except UserError as exc:
        raise UserError(f"{name}: base backbone {blob['base']}: {exc}") from None
    load_strict(staged, blob["state_dict"], who=name)
    staged.requires_grad_(False).eval()
    if getattr(base, "modality", "image") == "text":  # a trained text encoder (FedDRA stage 2): same tokenizer
        from embedcache.backbones.text import TextBackbone

        return TextBackbone(name, staged, base._tok, weights_sha256=sha, preprocess=preprocessing_of(base),
                            device=device, registry_base=base.name, note=str(blob.get("note", "")))
    return CkptBackbone(name, base, staged, weights_sha256=sha, note=str(blob.get("note", "")), device=device)


def _rows(weights_dir: Path | None) -> list[BackboneInfo]:
    return [BackboneInfo("ckpt:<path>", "a fine-tuned checkpoint of any backbone (fedheads finetune writes "
                         "RUN_DIR/state/seed<S>.backbone.pt)", True,
                         "the file names its base backbone, whose weights must be found", "checkpoint", None)]


register_family(PREFIX, create_ckpt, rows=_rows)
