"""The text path of `embedcache extract` (contracts 3d and 4): a text backbone embeds each
sample's `text` from the manifest in the same chunks and fixed batches as images (nothing to
decode: tokenizing takes microseconds per text); token backbones (`minilm-l6-v2:32@layer.5`) also
return the [n, T] mask that the shard stores beside the T-major rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from embedcache import store as st
from embedcache.errors import UserError


def is_text(backbone: Any) -> bool:
    return getattr(backbone, "modality", "image") == "text"


def embed_text_chunk(backbone: Any, texts: Sequence[str], spec: st.ShardSpec,
                     batch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Features (and, for token shards, the [n, T] mask) of one chunk of texts, in the fixed batches."""
    from embedcache.extract import batch_bounds  # the one definition of the fixed batches

    feats, masks = [], []
    for a, b in batch_bounds(len(texts), batch_size):
        with torch.inference_mode():
            out, mask = backbone.embed_texts(list(texts[a:b]))
        arr = out.detach().cpu().numpy().astype(np.float32, copy=False)
        if arr.shape != (b - a, spec.feature_dim):
            raise UserError(f"{backbone.name}: embed_texts() returned shape {arr.shape}, expected ({b - a}, {spec.feature_dim})")
        feats.append(arr)
        if spec.token_shape is not None:
            masks.append(mask.cpu().numpy().astype(np.bool_))
    f = np.concatenate(feats) if feats else np.zeros((0, spec.feature_dim), np.float32)
    if spec.token_shape is None:
        return f, None
    return f, (np.concatenate(masks) if masks else np.zeros((0, spec.token_shape[0]), np.bool_))


def text_notes(backbone: Any, texts: Sequence[str]) -> list[str]:
    """Truncation (texts longer than T) and, for token shards, padding worth a smaller T."""
    if not texts:
        return []
    lengths = backbone.token_lengths(texts)
    t, longest = backbone.max_length, max(lengths)
    notes = []
    cut = sum(n > t for n in lengths)
    if cut:
        notes.append(f"{backbone.name}: {cut} of {len(texts)} texts are longer than T={t} tokens and were truncated "
                     f"(longest {longest} tokens, [CLS]/[SEP] included)")
    elif getattr(backbone, "token_shape", None) is not None and longest <= t // 2:
        base, cut_name = backbone.name.rsplit("@", 1)
        notes.append(f"{backbone.name}: the longest text has {longest} tokens of T={t}: rows are mostly padding; "
                     f"{base.split(':')[0]}:{longest}@{cut_name} would store {t / longest:.1f}x less")
    return notes
