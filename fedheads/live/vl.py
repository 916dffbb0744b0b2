"""Adapters to the vision-language contracts FedDRA consumes (docs/contracts.md sections 1-4 as
extended for paired data, text encoders and token shards): the ONE place to change if those
contracts move. Everything FedDRA needs from a text encoder, a token shard or an exported
checkpoint goes through a function here.

Text encoder (contract 3, text backbones): a Backbone with `modality == "text"`,
`tokenize(texts) -> (ids [N, T] int64, mask [N, T] bool)` (padded; the attention mask is always
kept: MiniLM's tokenizer pads, and padded tokens must never be attended to), `token_states(ids,
mask) -> [N, T, D]` (frozen, before pooling), `feature_dim = D`, and `trainable()` returning a
module with the StagedNet stage API (`stage_names`, `stage(name)`) and `token_states(ids, mask)`.

Image token states (contract 3b): the map after a cut, `B@CUT` [C, H, W], read as H*W tokens of
C channels; a token model's stage output [T, D] is already tokens.

Token shards (contract 4): `features` [N, T*D] with attrs `token_shape` [T, D] (text) or a cut
map (`preprocess.map_shape` [C, H, W], stored in C, H, W order), plus an optional `mask` [N, T].

Exported encoders (contract 3, `ckpt:<path>` backbones): a torch file {format, base, state_dict,
sha256} that `embedcache extract --backbones ckpt:PATH` loads like any backbone.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from embedcache.errors import UserError
from fedheads.atomic import atomic_path

TEXT_TOKENS = "@tokens"  # store name of a text encoder's token states: "<text encoder>@tokens"
CKPT_FORMAT = "embedcache-ckpt/1"


# ------------------------------------------------------------------ text encoders
def open_text_encoder(name: str, weights_dir: str | None = None) -> Any:
    """The text backbone `name`; one line when it is not a text encoder."""
    from embedcache.backbones import create_backbone

    bb = create_backbone(name, weights_dir=weights_dir, device="cpu")
    if getattr(bb, "modality", "image") != "text" or not all(hasattr(bb, a) for a in ("tokenize", "token_states")):
        raise UserError(f"--text-encoder {name}: not a text encoder (needs modality 'text', tokenize and token_states)")
    return bb


def tokenize(bb: Any, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, T] int64, mask [N, T] bool) for `texts`, padded to the encoder's fixed length."""
    ids, mask = bb.tokenize(list(texts))
    return torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(mask).to(torch.bool)


def text_trainable(bb: Any) -> nn.Module:
    """A trainable copy of the text encoder (UserError naming it when it cannot train)."""
    fn = getattr(bb, "trainable", None)
    if fn is None:
        raise UserError(f"{bb.name}: cannot be trained in stage 2 (it has no trainable())")
    return fn()


def text_states(net: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token states [B, T, D] of the trainable text encoder (before pooling)."""
    return net.token_states(ids, mask)


def text_frozen_states(bb: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token states of the frozen text backbone (what its token shards hold)."""
    return torch.as_tensor(bb.token_states(ids, mask), dtype=torch.float32)


def stage_names(net: nn.Module) -> tuple[str, ...]:
    return tuple(net.stage_names)


def stage_module(net: nn.Module, name: str) -> nn.Module:
    return net.stage(name)


# ------------------------------------------------------------------ image token states
def map_tokens(x: torch.Tensor) -> torch.Tensor:
    """A cut map [B, C, H, W] as tokens [B, H*W, C]; token-model outputs [B, T, D] pass through."""
    if x.dim() == 4:
        return x.flatten(2).transpose(1, 2)
    if x.dim() == 3:
        return x
    raise UserError(f"image token states: expected a [B, C, H, W] map or [B, T, D] tokens, got {tuple(x.shape)}")


def image_token_shape(staged: nn.Module, cut: str) -> tuple[int, int]:
    """(T, D) of the tokens after `cut`."""
    shape = tuple(staged.stage_output_shape(cut))
    if len(shape) == 3:
        return shape[1] * shape[2], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    raise UserError(f"{staged.name}@{cut}: its output {list(shape)} is not a map or a token sequence; "
                    f"pick an earlier cut ({', '.join(staged.cut_points())})")


# ------------------------------------------------------------------ token shards
@dataclass(frozen=True)
class TokenSplit:
    tokens: torch.Tensor  # [N, T, D] float32
    mask: torch.Tensor | None  # [N, T] bool, None: every token valid
    sample_ids: np.ndarray  # [N] str, the shard's row order


def read_tokens(store: str, name: str, split: str, clients: Sequence[str]) -> dict[str, TokenSplit]:
    """Token states of `name` for each client: image maps (`map_shape`) or text tokens (`token_shape`)."""
    from embedcache.reader import load_split, open_store, shard_attributes

    info = open_store(store)
    try:
        data = load_split(info, [name], split, clients=list(clients), tokens=True)  # type: ignore[call-arg]
    except TypeError:  # a reader without token support: masks are read beside it (below)
        data = load_split(info, [name], split, clients=list(clients))
    out = {}
    for c in clients:
        sh = info.shard(name, c, split)
        attrs = shard_attributes(info, sh)
        feats = torch.from_numpy(np.ascontiguousarray(data[c].features, dtype=np.float32))
        mask = getattr(data[c], "mask", None)
        if mask is None:
            mask = _shard_mask(info, sh)
        pre = attrs.get("preprocess") or {}
        if attrs.get("token_shape"):
            T, D = (int(v) for v in attrs["token_shape"])
            tok = feats.view(-1, T, D)
        elif pre.get("map_shape"):
            tok = map_tokens(feats.view(-1, *(int(v) for v in pre["map_shape"])))
        else:
            raise UserError(f"{store}: {name}/{c}/{split} holds pooled features, not token states "
                            f"(extract a cut map B@CUT or {name}{TEXT_TOKENS})")
        out[c] = TokenSplit(tok.contiguous(), None if mask is None else torch.as_tensor(mask).to(torch.bool),
                            np.asarray(data[c].sample_ids))
    return out


def _shard_mask(info: Any, sh: Any) -> np.ndarray | None:
    from embedcache.reader import open_group

    group = open_group(info.path, info.consolidated)[sh.path]
    return np.asarray(group["mask"][...]) if "mask" in group else None


# ------------------------------------------------------------------ exported encoders
def export_encoder(path: Path, base: str, module: nn.Module, meta: dict[str, Any]) -> str:
    """Write a `ckpt:` checkpoint of a trained encoder atomically; returns its state sha256."""
    from embedcache.backbones.base import state_dict_sha256

    state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    sha = state_dict_sha256(state)
    buf = io.BytesIO()
    torch.save({"format": CKPT_FORMAT, "base": base, "state_dict": state, "sha256": sha, "meta": meta}, buf)
    with atomic_path(path) as tmp:
        tmp.write_bytes(buf.getvalue())
    return sha


def ckpt_backbones_available() -> bool:
    """Whether `ckpt:<path>` backbones exist in this installation (the few-shot probe needs them)."""
    from embedcache.backbones import create_backbone

    try:
        create_backbone("ckpt:/nonexistent/probe.pt")
    except UserError as exc:
        return "unknown backbone" not in str(exc)
    return True
