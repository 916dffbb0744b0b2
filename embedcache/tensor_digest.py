"""One identity for a set of named tensors, shared by whoever needs it without loading the backbone
registry: the backbones' weights identity (weights that did not come from a single file) and the
digests fedheads seals its state files with (fedheads/run/checkpoint.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def state_dict_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in sorted key order: a stable
    identity for weights that did not come from a single file (e.g. the timm hub cache)."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():  # the bytes in place: no copy of a large tensor just to hash it
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
