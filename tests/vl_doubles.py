"""Test doubles for FedDRA (imported, not collected): the tiny text backbone of text_doubles
(`tinytext`, a 2-layer 16-d BERT with the real TextBackbone / TextStagedNet classes, T = 12),
`tinytext-frozen` (a text encoder that cannot train) and `tinytext-other` (other weights); a
captioned manifest of tiny images; and a store with the image maps after `stem` and the text
token states `tinytext@layer.1`, both written by `embedcache extract`."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import live_doubles  # noqa: F401  (registers tiny-staged)
import text_plugin  # noqa: F401  (registers tinytext)
from store_doubles import make_imagefolder, make_manifest
from text_doubles import tiny_text_backbone

from embedcache.backbones.registry import register_backbone
from embedcache.errors import UserError
from embedcache.extraction import ExtractConfig, extract
from embedcache.manifest import Manifest

TEXT = "tinytext"
TEXT_TOKENS = "tinytext@layer.1"  # the last layer: the default --text-cut
COLOURS = ("red", "blue", "white")
PLACES = {"a": "in an office", "b": "on white background", "c": "in a market"}


def _frozen(name, wd=None, device="cpu"):
    base, _, cut = name.partition("@")
    bb = tiny_text_backbone(base)
    if cut:
        return bb.cut_backbone(cut)

    def refuse():
        raise UserError(f"{bb.name}: cannot be fine-tuned (test double)")
    bb.trainable = refuse
    return bb


def _other(name, wd=None, device="cpu"):
    base, _, cut = name.partition("@")
    bb = tiny_text_backbone(base, seed=1)
    return bb.cut_backbone(cut) if cut else bb


for _name, _factory in (("tinytext-frozen", _frozen), ("tinytext-other", _other)):
    register_backbone(_name, lambda wd, dev, f=_factory, n=_name: f(n, wd, dev), modality="text",
                      cut_points=("embeddings", "layer.0", "layer.1"), feature_dim=16,
                      description=f"test double: {_name}")


def caption(sample_id: str, label_name: str, domain: str) -> str:
    """Deterministic captions from the double's vocabulary: colour and size from the id's hash."""
    h = int(hashlib.sha256(sample_id.encode()).hexdigest(), 16)
    return f"a {COLOURS[h % 3]} {('small', 'large')[h // 3 % 2]} photo of the {label_name} {PLACES.get(domain, '')}"


def captioned(m: Manifest) -> Manifest:
    clients = []
    for c in m.clients:
        fix = lambda ss, c=c: tuple(dataclasses.replace(s, text=caption(s.id, m.classes[s.label], c.domain)) for s in ss)  # noqa: E731
        clients.append(dataclasses.replace(c, train=fix(c.train), test=fix(c.test)))
    return Manifest(m.source, m.classes, tuple(clients))


def make_paired(root: Path, per_class: int = 9) -> tuple[Manifest, str]:
    """Three clients (domains a, b, c) of 3 classes; a store with the image maps after `stem` and
    the text token states after `layer.1`."""
    make_imagefolder(root / "img", domains=("a", "b", "c"), classes=("cat", "dog", "emu"), per_class=per_class, size=10)
    m = captioned(make_manifest(root / "img", test_every=3))
    store = str(root / "s.zarr")
    extract(m, ExtractConfig(backbones=("tiny-staged", "tiny-staged@stem", TEXT_TOKENS), store=store, batch_size=64,
                             progress=False, device="cpu"))  # float32 (CUDA extracts in bf16)
    return m, store


def extract_other_text_weights(m: Manifest, store: str) -> None:
    """A store whose `tinytext@layer.1` shards come from other weights (the image maps are right)."""
    from text_doubles import tiny_text_factory

    register_backbone(TEXT, lambda wd, dev: _other(TEXT, wd, dev), modality="text",
                      cut_points=("embeddings", "layer.0", "layer.1"), feature_dim=16, description="other weights")
    try:
        extract(m, ExtractConfig(backbones=("tiny-staged@stem", TEXT_TOKENS), store=store, progress=False,
                                 device="cpu"))
    finally:
        register_backbone(TEXT, lambda wd, dev: tiny_text_factory(TEXT, wd, dev), modality="text",
                          cut_points=("embeddings", "layer.0", "layer.1"), feature_dim=16,
                          description="test double: a 2-layer 16-d BERT (text)")
