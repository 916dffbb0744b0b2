"""`--plugin text_plugin`: registers the tiny text double `tinytext` (text_doubles.py) so that CLI
tests run `embedcache extract --backbones tinytext@layer.1` like a user runs minilm-l6-v2:32@layer.5."""

from __future__ import annotations

from text_doubles import tiny_text_factory

from embedcache.backbones import register_backbone

register_backbone("tinytext", lambda wd, dev: tiny_text_factory("tinytext", wd, dev), modality="text",
                  cut_points=("embeddings", "layer.0", "layer.1"), feature_dim=16,
                  description="test double: a 2-layer 16-d BERT (text)")
