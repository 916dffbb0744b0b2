"""Adapters to the vision-language contracts FedDRA consumes (docs/contracts.md 3b, 3d, 3f, 4): the
ONE place to change if those contracts move. Everything FedDRA needs from a text encoder, a token
shard or an exported checkpoint goes through a function here.

Text encoder (contract 3d): a `TextBackbone` (`modality == "text"`, `tokenize(texts,
pad_to_max_length=True) -> (ids [N, T] int64, mask [N, T] bool)`; the attention mask is always kept:
padded tokens must never be attended to) whose `trainable()` is a `TextStagedNet` run as
`net(ids, stop=CUT, mask=mask)`. FedDRA's text token states are the states after CUT (default the
last layer), zeroed where the mask is False, exactly what the `TEXT@CUT` token shards hold.

Image token states (contract 3b): the map after a cut, `B@CUT` [C, H, W], read as H*W tokens of
C channels; a token model's stage output [T, D] is already tokens.

Token shards (contract 4): read with `load_split(...)` and `ClientSplit.tokens()` ([N, T, D]) plus
the shard's `mask` (text) or None (image maps: every token valid).

Exported encoders (contract 3f): `ckpt:` files written by `save_backbone_checkpoint`, so that
`embedcache extract --backbones ckpt:PATH` caches a trained encoder like any backbone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from embedcache.errors import UserError


# ------------------------------------------------------------------ text encoders
def open_text_encoder(name: str, weights_dir: str | None = None) -> Any:
    """The text backbone `name`; one line when it is not a text encoder."""
    from embedcache.backbones import create_backbone

    bb = create_backbone(name, weights_dir=weights_dir, device="cpu")
    if getattr(bb, "modality", "image") != "text" or not all(hasattr(bb, a) for a in ("tokenize", "cut_backbone")):
        raise UserError(f"--text-encoder {name}: not a text encoder (contract 3d: modality 'text', tokenize, "
                        "cut_backbone); name the pooled backbone, not a B@CUT")
    if getattr(bb, "cut", None) is not None:
        raise UserError(f"--text-encoder {name}: a cut backbone; name its base and give --text-cut")
    return bb


def text_cut(bb: Any, cut: str | None) -> str:
    """The text token cut: `cut`, or the encoder's last layer (what its pooled embedding averages)."""
    net = getattr(bb, "_net", None)  # TextBackbone's frozen TextStagedNet: no deep copy just to read names
    cuts = tuple((net if net is not None else bb.trainable()).cut_points())
    if cut is None:
        return cuts[-1]
    if cut not in cuts:
        raise UserError(f"--text-cut {cut}: {bb.name} has no cut {cut!r} (cut points: {', '.join(cuts)})")
    return cut


def tokenize(bb: Any, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, T] int64, mask [N, T] bool), padded to the encoder's T like the store's rows."""
    ids, mask = bb.tokenize(list(texts), pad_to_max_length=True)
    return torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(mask).to(torch.bool)


def text_trainable(bb: Any) -> nn.Module:
    """A trainable copy of the text encoder (UserError naming it when it cannot train)."""
    fn = getattr(bb, "trainable", None)
    if fn is None:
        raise UserError(f"{bb.name}: cannot be trained in stage 2 (it has no trainable())")
    return fn()


def text_states(net: nn.Module, ids: torch.Tensor, mask: torch.Tensor, cut: str) -> torch.Tensor:
    """Token states [B, T, D] after `cut`, 0 where the mask is False (contract 3d leaves those
    positions unspecified; the store holds 0 there)."""
    out = net(ids, stop=cut, mask=mask)
    return out * mask.unsqueeze(-1).to(out.dtype)


class FrozenText(nn.Module):
    """A text backbone that does not train in stage 2 (or cannot), as the module DualEncoder
    needs: no stages to train, token states from the frozen `B@CUT` backbone."""

    stage_names: tuple[str, ...] = ()

    def __init__(self, bb: Any, cut: str) -> None:
        super().__init__()
        self.bb, self.cut_bb = bb, bb.cut_backbone(cut)

    def stage(self, name: str) -> nn.Module:
        raise UserError(f"{self.bb.name}: cannot be trained in stage 2")

    def forward(self, ids: torch.Tensor, stop: str | None = None, *, mask: torch.Tensor) -> torch.Tensor:
        T, D = self.cut_bb.token_shape
        rows = self.cut_bb.embed((ids.cpu(), mask.cpu())).view(ids.shape[0], T, D)
        return rows[:, : ids.shape[1]].to(ids.device)


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
    """Token states of `name` for each client: image maps or text token shards (contract 4)."""
    from embedcache.store.reader import load_split

    data = load_split(store, [name], split, clients=list(clients))
    out = {}
    for c in clients:
        d = data[c]
        if d.token_shape is None:
            raise UserError(f"{store}: {name}/{c}/{split} holds pooled features, not token states "
                            f"(extract a cut B@CUT)")
        tok = torch.from_numpy(np.ascontiguousarray(d.tokens(), dtype=np.float32))
        out[c] = TokenSplit(tok, None if d.mask is None else torch.from_numpy(np.asarray(d.mask, dtype=bool)),
                            np.asarray(d.sample_ids))
    return out


# ------------------------------------------------------------------ exported encoders
def export_encoder(path: Path, base: str, module: nn.Module, note: str) -> str:
    """Write a trained encoder as a `ckpt:` file (contract 3f) atomically; returns the file's sha256."""
    from embedcache.backbones.ckpt import save_backbone_checkpoint

    return save_backbone_checkpoint(path, base, module, note)
