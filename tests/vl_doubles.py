"""Test doubles for FedDRA (imported, not collected): a tiny text encoder implementing the text
contract FedDRA consumes (fedheads.live.vl: modality "text", tokenize -> (ids, mask) padded to a
fixed length, token_states, trainable() with stages), registered as "tiny-text" ("tiny-text-frozen"
cannot train); a captioned manifest of tiny images; and token shards written with
embedcache.store's writer (text tokens [N, T*D] + token_shape + mask), beside the image maps
that `embedcache extract` writes for "tiny-staged@stem"."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import nn

import live_doubles  # noqa: F401  (registers tiny-staged)
from embedcache import store as st
from embedcache.backbones.base import state_dict_sha256
from embedcache.backbones.registry import register_backbone
from embedcache.errors import UserError
from embedcache.extract import ExtractConfig, extract
from embedcache.manifest import Manifest
from store_doubles import make_imagefolder, make_manifest

VOCAB = ("[pad]", "[cls]", "[unk]", "a", "photo", "of", "the", "cat", "dog", "emu", "red", "green", "blue", "small",
         "large", "in", "domain", "b", "c")
MAX_LEN = 8
DIM = 6
COLOURS = ("red", "green", "blue")


class TinyTextNet(nn.Module):
    """embeddings (nn.Embedding) -> layer.0 (tanh(W e_t + U masked-mean(e))): mask-aware, so
    padded tokens change nothing unless the mask is ignored."""

    stage_names = ("embeddings", "layer.0")
    name = "tiny-text"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embeddings = nn.Embedding(len(VOCAB), DIM)
        self.layer = nn.ModuleDict({"w": nn.Linear(DIM, DIM), "u": nn.Linear(DIM, DIM, bias=False)})
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.7)

    def stage(self, name: str) -> nn.Module:
        return {"embeddings": self.embeddings, "layer.0": self.layer}[name]

    def token_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = self.embeddings(ids)
        w = mask.to(e.dtype).unsqueeze(-1)
        ctx = (e * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1.0)
        return torch.tanh(self.layer["w"](e) + self.layer["u"](ctx))


class TinyText:
    """The text backbone (frozen; `trainable()` hands out a deep copy)."""

    modality = "text"
    feature_dim = DIM
    can_train = True

    def __init__(self, name: str = "tiny-text") -> None:
        self.name = name
        self.net = TinyTextNet().eval().requires_grad_(False)
        self.weights_sha256 = state_dict_sha256(self.net.state_dict())
        self.preprocess = {"tokenizer": "tiny-vocab", "vocab_size": len(VOCAB), "max_length": MAX_LEN}

    def tokenize(self, texts):
        ids = torch.zeros((len(texts), MAX_LEN), dtype=torch.int64)
        mask = torch.zeros((len(texts), MAX_LEN), dtype=torch.bool)
        for i, t in enumerate(texts):
            toks = [1] + [VOCAB.index(w) if w in VOCAB else 2 for w in t.lower().split()]
            toks = toks[:MAX_LEN]
            ids[i, :len(toks)] = torch.tensor(toks)
            mask[i, :len(toks)] = True
        return ids, mask

    @torch.no_grad()
    def token_states(self, ids, mask):
        return self.net.token_states(ids, mask)

    def embed(self, ids, mask):  # pooled + L2, as sentence-transformers' output
        s = self.token_states(ids, mask)
        w = mask.float().unsqueeze(-1)
        return nn.functional.normalize((s * w).sum(1) / w.sum(1), dim=-1)

    def to(self, device):
        return self

    def trainable(self) -> TinyTextNet:
        if not self.can_train:
            raise UserError(f"{self.name}: cannot be fine-tuned (test double)")
        return copy.deepcopy(self.net).requires_grad_(True)


def _frozen(wd=None, device="cpu") -> TinyText:
    bb = TinyText("tiny-text-frozen")
    bb.can_train = False
    return bb


register_backbone("tiny-text", lambda wd=None, device="cpu": TinyText(), description="test double: tiny text encoder")
register_backbone("tiny-text-frozen", _frozen, description="test double: a text encoder that cannot train")


def caption(sample_id: str, label_name: str, domain: str) -> str:
    """Deterministic captions: a colour from the id's hash, the class and the domain."""
    h = int(hashlib.sha256(sample_id.encode()).hexdigest(), 16)
    return f"a {COLOURS[h % 3]} {('small', 'large')[h // 3 % 2]} photo of the {label_name} in domain {domain}"


def captioned(m: Manifest) -> Manifest:
    clients = []
    for c in m.clients:
        fix = lambda ss: tuple(dataclasses.replace(s, text=caption(s.id, m.classes[s.label], c.domain)) for s in ss)  # noqa: E731
        clients.append(dataclasses.replace(c, train=fix(c.train), test=fix(c.test)))
    return Manifest(m.source, m.classes, tuple(clients))


def write_text_tokens(store: str, m: Manifest, bb: TinyText | None = None, name: str = "tiny-text@tokens") -> None:
    """Text token shards: features [N, T*D] (T-major), attrs token_shape [T, D], a mask [N, T]."""
    import zarr

    bb = bb or TinyText()
    for c in m.clients:
        for split in ("train", "test"):
            samples = getattr(c, split)
            ids, mask = bb.tokenize([s.text for s in samples])
            feats = bb.token_states(ids, mask).reshape(len(samples), -1).numpy().astype(np.float32)
            spec = st.ShardSpec(backbone=name, weights_sha256=bb.weights_sha256, preprocess=dict(bb.preprocess),
                                feature_dim=MAX_LEN * DIM, client=c.name, split=split, domain=c.domain,
                                manifest_hash=m.content_hash, sample_list_hash=m.sample_list_hash(c.name, split),
                                sample_ids=tuple(s.id for s in samples), labels=tuple(s.label for s in samples))
            st.write_shard(store, spec, feats)
            g = zarr.open_group(str(Path(store) / st.backbone_key(name) / c.name / split), mode="r+")
            g.attrs["token_shape"] = [MAX_LEN, DIM]
            g.create_array("mask", data=mask.numpy())
    st.consolidate(store)


def make_paired(root: Path, per_class: int = 9) -> tuple[Manifest, str]:
    """Three clients (domains a, b, c) of 3 classes; a store with the image maps after `stem` and
    the text tokens."""
    make_imagefolder(root / "img", domains=("a", "b", "c"), classes=("cat", "dog", "emu"), per_class=per_class, size=10)
    m = captioned(make_manifest(root / "img", test_every=3))
    store = str(root / "s.zarr")
    extract(m, ExtractConfig(backbones=("tiny-staged", "tiny-staged@stem"), store=store, batch_size=64, progress=False))
    write_text_tokens(store, m)
    return m, store
